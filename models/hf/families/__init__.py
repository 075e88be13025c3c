"""The Hugging Face model families ``models.hf`` reads and writes: one record
(``models.hf.family.Family``) per file of this folder, listed in ``FAMILIES``.

Adding a family is its file here and its entry in ``FAMILIES``. An import finds its family
by ``config.json``'s ``architectures[0]``; an export takes the first family of
``FAMILIES`` that expresses the model's config (``Family.expresses``).
"""

from models.hf.families import llama, qwen2, qwen3, qwen3_moe

FAMILIES = (qwen3.FAMILY, qwen3_moe.FAMILY, qwen2.FAMILY, llama.FAMILY)
