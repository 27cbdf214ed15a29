"""Score neurons: HOPE's view of each channel from BatchNorm statistics alone.

* `neurons`: each group's surrogate (BN scale and shift, activation, consumer weights).
* `moments`: activation moments of each channel under the Gaussian surrogate.
* `cache`, `cache_builders`: each group's Gram and kernel quantities, built once.
* `costs`, `cost_formulas`: the prices of prune, merge and evict (`hope_keras.costs`).
* `analysis`: `analyze`, the capacities and costs of a model without changing it.
"""
