"""The KV caches, one interface: ``KVCache`` (``dense``: a fixed number of slots per row,
for prefill and one-token decode) and ``PagedKVCache`` (``paged``: a pool of pages rows
share, for the paged engine). A cache has ``begin(positions, segment_ids)`` (before a
forward: ``(cache, overflow)``), ``layer(i)`` (the view one attention layer reads and
writes) and ``end(keys, values, num_new)`` (after the forward); a layer's view has
``write(keys, values)`` and ``attend(q, k, v, attention)``, which writes the new tokens and
calls the attention layer's read for that kind of cache (``over_cache`` /
``over_pages``). The decoder and the attention layer never ask which kind they hold.
"""

from models.cache.dense import (
    KVCache,
    LayerKV,
    check_room,
    init_cache,
    layer_view,
    write_kv,
    write_tokens,
)
from models.cache.paged import (
    PagedKVCache,
    PagedLayerKV,
    along_pages,
    init_pages,
    paged_view,
    per_shard,
    write_pages,
)

__all__ = ["KVCache", "LayerKV", "PagedKVCache", "PagedLayerKV", "along_pages",
           "check_room", "init_cache", "init_pages", "layer_view", "paged_view", "per_shard",
           "write_kv", "write_pages", "write_tokens"]
