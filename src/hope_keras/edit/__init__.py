"""Edit the model: each action applied to the Keras model in place, and `slim`.

* `editor`: prunes, merges and evictions written into the weights (masks, parent
  coefficients), so every step of a run is a valid model.
* `slim`: a physically smaller model, equal to the edited one.
"""
