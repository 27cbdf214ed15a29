"""Deploy: what comes after compression.

* `recover`: BN re-estimation and distillation from the original.
* `profile`: parameters, FLOPs and latency against a reference.
* `export`: TensorFlow Lite.
"""
