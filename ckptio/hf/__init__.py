"""Hugging Face safetensors in and out: the file format (``format``), the DCP reader of safetensors
weights (``reader``) and the export of a checkpoint as safetensors shards (``export``)."""
