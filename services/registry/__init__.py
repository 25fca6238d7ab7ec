"""The model registry on NATS JetStream: versions, files, aliases (prod / canary).

`store.Registry` is the library (reading in `store`, pushing in `push`, aliases in
`aliases`); `source.ModelSource` is what a worker loads from;
`alias_table.AliasTable` caches aliases for the services that route or judge by them;
`routing.choose_version` splits traffic; `seed.seed_bundled` fills an empty registry;
`cli.main` is `tensorbus registry ...`.
"""
