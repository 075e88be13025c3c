"""The RL step and what it runs on: the functional model (``state``) and where its arrays
live (``placement``); the rollout sampler (``rollout``); packing into rows
(``packing``); the loss math (``rl_loss``); the optimiser (``optim``); the jitted steps
(``steps``) and the updates of one GRPO step (``updates``); the non-finite guard
(``nonfinite``)."""
