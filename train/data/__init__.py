"""The trainer's data: reasoning-gym prompts, answers, rewards and the held-out split
(``tasks``), and the tokenizers with their chat format (``tokenizer``)."""
