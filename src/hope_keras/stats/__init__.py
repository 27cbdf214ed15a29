"""Correct statistics: BatchNorm moving statistics after an edit, with or without data.

* `bn_stats`: re-estimation on real data, and the data-free surrogate correction.
* `synthetic`: synthetic inputs whose BN statistics match the model's.
* `correction`: `StatisticsCorrection`, run by the encoder after each run.
* `calibration`: `calibrate`, BN statistics for BN-free networks.
"""
