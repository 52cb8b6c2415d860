"""Trainer callbacks: DiLoCo inside a training loop someone else wrote.

* ``diloco.integrations.transformers.DilocoCallback``: the Hugging Face ``Trainer``
  (``pip install 'diloco[transformers]'``).
* ``diloco.integrations.lightning.DilocoCallback``: Lightning's ``Trainer``
  (``pip install 'diloco[lightning]'``).

Both are thin: the trainer's hooks drive one ``diloco.Worker`` (``attached.py``),
which already knows how to join, sync, pause below quorum and leave. Importing
this package imports neither trainer; each module imports only its own.
"""
