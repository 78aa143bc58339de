"""Benchmark accel_kernels against eager torch, torch.compile and Liger Kernel.

    python -m accel_kernels.bench [--quick] [--ops rms_norm,rope,...] [--json PATH]

One module per job:

    catalogue.py   the ops: shapes, input makers, eager formulas, Liger adapters
    harness.py     the correctness guard and the measuring (CUDA and CPU): records, no printing
    report.py      every derived figure (ratios, bandwidth) computed once into the records; the
                   tables, the CPU summary and the JSON read those same records
    cli.py         the command line (`__main__.py` runs it)
    memory.py      LiveBytes: the peak of the storages ops make, on any device (tests, step_memory.py)

Method and figures: BENCHMARKS.md at the repository root.
"""
