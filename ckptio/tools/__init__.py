"""What works on whole checkpoints from outside a training job: the ``ckptio`` command (``cli``),
``inspect`` (``inspection``), ``verify``, ``gc`` and removal (``cleanup``), and conversions
(``convert``)."""
