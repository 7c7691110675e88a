"""What checkpoints look like on disk: the DCP directory layout and its file names (``layout``), Lightning's own
checkpoint layouts (``lightning_layouts``), Hugging Face safetensors (``safetensors_stream``, ``hf_checks``), and
the formats of other torch versions (``torch_versions``).

May import: ``lightning_fsdp._base``, torch, the standard library. Nothing else of ``checkpoint``.
"""
