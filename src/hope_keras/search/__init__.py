"""Search actions: the greedy HOPE encoder and what it records.

* `encoder`: `compress` and `Encoder`, the greedy loop.
* `merge_search`, `candidates`, `merge_tables`: each group's cheapest merge.
* `actions`, `evictions`: the ranked queue of prunes, merges and block evictions.
* `budgets`, `sizes`: when a run stops, and the live parameter and FLOPs counts.
* `recording`, `trajectory`: the executed steps, saved, loaded and replayed.
* `baselines`: magnitude criteria and Neuron Merging through the same edits
  (`hope_keras.baselines`).
"""
