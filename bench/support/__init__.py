"""What the benchmarks and the tests both use: request inputs (`workload`), load
generators (`load`), percentiles (`stats`), the perplexity texts (`texts`), the fault
and orchestrator scenarios as processes (`faults`, `orchestration`) and tiny models
built locally (`tiny_encoders`, `tiny_tokenizer`). Here, not in tests/support/: the
tests may import bench/, bench/ never imports tests/.
"""
