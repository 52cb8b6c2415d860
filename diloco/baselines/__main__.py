"""``python -m diloco.baselines``: the calibration comparison (see :func:`diloco.baselines.compare.main`)."""

from diloco.baselines.compare import main

if __name__ == "__main__":
    raise SystemExit(main())
