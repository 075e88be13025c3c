"""The Qwen3-MoE block, one op folder (as ``jaxhead/_src/head/``).

  layer.py        ``MoE`` (router + experts), ``route``, ``RouterStats``,
                  ``load_balancing_loss``, ``dropped_fraction``
  api.py          ``routed_experts`` (expert parallelism under a mesh), ``REGISTRY`` (the
                  ``ModelConfig.expert_dispatch`` values) and its ``"auto"``, the
                  capacity / overflow checks
  experts.py      what every path shares: grouped SwiGLU ``expert_ffn``, ``combine``,
                  ``route_valid``, ``token_chunks`` (``ModelConfig.moe_token_chunk``)
  reference.py    ``dropless_experts``: one device, no mesh
  dense.py        ``"dense"``: worst-case blocks and ``all_to_all``
  ragged.py       ``"ragged"``: ``ragged_all_to_all`` (emulated on CPU), the capacity rule

The layer is imported from ``models.moe.layer`` (it needs ``models.config``); this
package's API is the op, which needs no config: ``models.transformer.check_ops`` checks a
config's MoE dispatch settings against ``REGISTRY`` and ``api``'s checks where the model
is built.
"""

from models.moe.api import OVERFLOWS, REGISTRY, routed_experts
from models.moe.reference import dropless_experts

__all__ = ["OVERFLOWS", "REGISTRY", "dropless_experts", "routed_experts"]
