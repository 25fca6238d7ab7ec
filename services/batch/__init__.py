"""The batch runner: works through `/v1/batches` on the public inference subjects."""
