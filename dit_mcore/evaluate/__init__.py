"""Sample quality of a trained checkpoint: FID through torchmetrics (``python -m dit_mcore.evaluate``,
:mod:`dit_mcore.evaluate.cli`), on the features of torchmetrics' InceptionV3 or, for the built-in digits, of a
small network trained on the real digits in seconds (:mod:`dit_mcore.evaluate.features`)."""
