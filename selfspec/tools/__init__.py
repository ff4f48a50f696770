"""Tools around the engine: the benchmark (`bench`), the calibrator (`calibrate`: search space, study, report),
the cost model and loop replay they and head evaluation share (`cost_model`, `replay`), and the measuring
helpers all of them use (`measure`: device sync, timing, environment, model identity, EOS ids, rank correlation).

Nothing here is imported by `selfspec.wrap` or the decode loop; the engine lives in the package folder above.
"""
