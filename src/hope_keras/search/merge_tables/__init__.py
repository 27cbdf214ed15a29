"""The merge tables behind `hope_keras.search.candidates.MergeTable`, one module a kind.

* `bounds`: the pair values and the C-free lower bounds every table prices with;
* `refinement`: pairs re-priced from exact Gram entries (sketched groups);
* `dense`: `DenseTable`, every pair's bound, each pair priced once;
* `rows`: `PartnerRows`, k partners per neuron (every partner: the exhaustive scan);
* `certified`: `CertifiedRows`, rows whose bounds certify the exhaustive scan's pair;
* `kernels`: the tables' per-step loops, compiled with numba;
* `top_k`: `TopKRows`, the best pair among each row's k partners (``"top_k"``).

`hope_keras.search.candidates.MergeTable(...)` builds the kind its arguments ask for.
"""
