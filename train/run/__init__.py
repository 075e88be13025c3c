"""A run: its config schema (``schema``) and run directory (``resume``), what it builds
before its loops (``setup``), processes (``distributed``), the loop both stages share
(``loop``) with its checkpoints (``checkpoint``) and metrics (``metrics``), the rollouts'
experience for the updates (``experience``), the held-out evaluation (``evaluate``) and
the GRPO curve (``plot``)."""
