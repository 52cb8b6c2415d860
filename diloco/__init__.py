"""diloco: DiLoCo training whose membership rules live in one pure, proven state machine.

The one rule: no outer step is ever applied with fewer than ``min_workers``
contributors. See SPEC.md.
"""

__version__ = "0.1.0"
