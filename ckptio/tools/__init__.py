"""What works on whole checkpoints from outside a training job: the ``ckptio`` command (``cli``),
inspect / verify / gc / delete (``report``) and conversions (``convert``)."""
