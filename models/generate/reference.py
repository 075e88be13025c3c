"""``reference``: the whole batch decodes until its longest row stops.

Every row is prefilled (a prompt sampled G times is prefilled G times), the cache holds
``prompt width + max_new_tokens`` slots per row from the start, and the decode
``while_loop`` computes every row at every step, finished rows masked after the fact: a
call costs ``B x longest`` token-steps. The engine the others are checked against
(``models.generate.compact``), and the simple engine Tunix's vanilla sampler also is.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from models.generate.api import (
    Decoding,
    EngineSettings,
    Jit,
    Layout,
    Place,
    Read,
    Work,
    along_batch,
    draw,
    empty_record,
    empty_routes,
    ended,
    masked,
    record_routes,
    row_requests,
)


def generate(model, prompts: jax.Array, lens: jax.Array, source: jax.Array,
             budgets: jax.Array, request: jax.Array, sample: jax.Array, real_rows: jax.Array,
             key: jax.Array, temperature, trunc, d: Decoding) -> tuple[jax.Array, ...]:
    """One call's rollouts, traced (the caller jits it).

    Args:
      model: the decoder (``models.Transformer``).
      prompts: int32 ``[U, W]`` right-padded prompts; lens: int32 ``[U]`` their lengths.
      source: int32 ``[B]``: the prompt row ``r`` continues (``r // G`` for real rows).
      budgets: int32 ``[B]``: row ``r`` decodes at most ``budgets[r] <= T`` tokens.
      request, sample: int32 ``[B]``: row ``r`` is sample ``sample[r]`` of request
        ``request[r]`` (``models.generate.api.row_requests``), which keys its draws.
      real_rows: int32 scalar: rows from it on are padding (finished from the start).
      key, temperature, trunc: the draw's key, temperature (0: greedy) and
        ``Truncation`` values (traced).
      d: the static settings.

    Returns:
      ``(tokens, logprobs, min_logit, logmass)`` ``[B, T]`` (``FILL`` after a row's last
      token), ``lengths`` int32 ``[B]`` and ``stopped`` bool ``[B]`` (the row drew a stop
      token); with ``d.record_routes`` also the rows' prompt routes ``[B, W, M, k]`` and
      completion routes ``[B, T, M, k]`` int32 (``models.generate.api.record_routes``).
    """
    prompts, lens = prompts[source], lens[source]
    batch, width = prompts.shape
    steps = d.max_new_tokens
    cache = along_batch(model.init_cache(batch, width + steps))
    pos = jnp.broadcast_to(jnp.arange(width, dtype=jnp.int32), prompts.shape)
    out = model(prompts, pos, (pos < lens[:, None]).astype(jnp.int32), cache)
    routes = ()
    if d.record_routes:
        routes = (record_routes(model, out.routes, pos < lens[:, None]),
                  along_batch(empty_routes(model, batch, steps)))
    rows = jnp.arange(batch, dtype=jnp.int32)
    first = draw(model, out.hidden[rows, lens - 1], key, 0, temperature, trunc, d, request,
                 sample)
    record = tuple(r.at[:, 0].set(x) for r, x in zip(empty_record(batch, steps), first))
    length = jnp.ones((batch,), jnp.int32)
    stopped, spent = ended(first.tokens, length, budgets, d)
    done = stopped | spent | (rows >= real_rows)
    carry = (jnp.int32(1), first.tokens, along_batch(out.cache), along_batch(record), done,
             stopped, length, routes[1:])

    def cond(c):
        return (c[0] < steps) & ~jnp.all(c[4])

    def body(c):
        step, tok, cache, record, done, stopped, length, taken = c
        p = (lens + step - 1)[:, None]
        o = model(tok[:, None], p, jnp.ones_like(p), cache)
        if taken:  # completion token step - 1 ran: its experts
            taken = (taken[0].at[:, step - 1].set(
                record_routes(model, o.routes, ~done[:, None])[:, 0]),)
        new = masked(draw(model, o.hidden[:, 0], key, step, temperature, trunc, d, request,
                          sample), done)
        record = tuple(r.at[:, step].set(x) for r, x in zip(record, new))
        length = length + (~done).astype(jnp.int32)
        stop, spent = ended(new[0], length, budgets, d)
        return (step + 1, new[0], along_batch(o.cache), record, done | stop | spent,
                stopped | (stop & ~done), length, along_batch(taken))

    _, _, _, record, _, stopped, length, taken = jax.lax.while_loop(cond, body, carry)
    return (*record, length, stopped, *routes[:1], *taken)


class ReferenceEngine:
    """The ``reference`` engine, in the shape every engine has (``models.generate.ENGINES``):
    built from the model and ``Decoding``, called on host prompts and budgets, returning
    the record and the ``Work`` it did, its compiled function reachable by name.

    Args:
      merge: ``params -> model``.
      d: the static settings.
      settings: ``EngineSettings`` (this engine reads ``row_multiple``: the rows are padded
        with copies of row 0 to a multiple of the batch shards).
      jit, read, place: how its function compiles, device rows are read back and host rows
        are put on the devices (``models.generate.api``).
      layout: the shardings of its arguments on a mesh (None: one device).
    """

    def __init__(self, merge: Callable, d: Decoding, settings: EngineSettings | None = None,
                 *, jit: Jit = jax.jit, read: Read = jax.device_get,
                 place: Place = lambda arrays: arrays, layout: Layout | None = None):
        settings = EngineSettings() if settings is None else settings
        self.merge, self.d, self.shards = merge, d, settings.row_multiple
        self.jit, self.read, self.place, self.layout = jit, read, place, layout
        self._decode = None

    def compiled(self, name: str = "decode", static=None):
        """The jitted decoder (``name = "decode"``, the only one: ``generate``'s arguments
        after ``params``; its ``.lower(...)`` gives the program).

        Raises:
          ValueError: another name.
        """
        if name != "decode":
            raise ValueError(f"the reference engine compiles one function, 'decode'; "
                             f"got {name!r}")
        if self._decode is None:
            d, merge = self.d, self.merge

            def fn(params, *args):
                return generate(merge(params), *args, d)

            kw = {}
            if self.layout is not None:
                params, rows, rep = self.layout
                kw = {"in_shardings": (params, rows, rows, rows, rows, rows, rows, rep, rep,
                                       rep, (rep, rep, rep)),
                      "out_shardings": (rows,) * (8 if d.record_routes else 6)}
            self._decode = self.jit(fn, **kw)
        return self._decode

    def arguments(self, prompts, lens, budgets: np.ndarray, key, temperature, trunc, *,
                  group_size: int, request_ids=None) -> tuple:
        """The decoder's arguments after ``params`` for ``__call__``'s (placed)."""
        rows = len(budgets)
        size = rows + -rows % self.shards
        source = np.minimum(np.arange(size) // group_size, len(prompts) - 1).astype(np.int32)
        source[rows:] = 0
        full = np.full(size, self.d.max_new_tokens, np.int32)
        full[:rows] = budgets
        request, sample = row_requests(request_ids, rows // group_size, group_size, size)
        b = self.place({"prompts": np.asarray(prompts), "lens": np.asarray(lens)})
        r = self.place({"source": source, "budgets": full, "request": request,
                        "sample": sample})
        return (b["prompts"], b["lens"], r["source"], r["budgets"], r["request"],
                r["sample"], jnp.int32(rows), key, jnp.float32(temperature), trunc)

    def lower(self, params, prompts, lens, budgets, key, temperature, trunc, *,
              group_size: int):
        """The decoder of these arguments, lowered (``jax.stages.Lowered``)."""
        args = self.arguments(prompts, lens, budgets, key, temperature, trunc,
                              group_size=group_size)
        return self.compiled().lower(params, *args)

    def __call__(self, params, prompts, lens, budgets: np.ndarray, key, temperature, trunc,
                 *, group_size: int, request_ids=None) -> tuple[tuple, Work]:
        """Rollouts of ``len(budgets)`` rows (``G`` per prompt row, in order), as
        ``models.generate.CompactEngine.__call__``: host ``prompts`` / ``lens`` ``[U, W]``
        / ``[U]``, ``budgets`` ``[B]``; returns ``(record, work)`` (``generate``'s
        record, its rows padded to the shards, the first B real)."""
        args = self.arguments(prompts, lens, budgets, key, temperature, trunc,
                              group_size=group_size, request_ids=request_ids)
        out = self.read(self.compiled()(params, *args))
        rows, size, width = len(budgets), len(args[2]), prompts.shape[1]
        steps = max(int(np.asarray(out[4])[:rows].max()) - 1, 0)  # to the longest row
        slots = int(size * (width + self.d.max_new_tokens))
        tokens = int(np.asarray(lens)[:rows // group_size].sum())  # each prompt's, once
        work = Work(tokens * group_size, int(size * width), size * steps, slots, slots)
        return out, work
