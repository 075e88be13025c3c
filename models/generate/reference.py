"""``reference``: the whole batch decodes until its longest row stops.

Every row is prefilled (a prompt sampled G times is prefilled G times), the cache holds
``prompt width + max_new_tokens`` slots per row from the start, and the decode
``while_loop`` computes every row at every step, finished rows masked after the fact: a
call costs ``B x longest`` token-steps. The engine the others are checked against
(``models.generate.compact``), and the simple engine Tunix's vanilla sampler also is.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.generate.api import (
    Decoding,
    along_batch,
    draw,
    empty_record,
    empty_routes,
    ended,
    masked,
    record_routes,
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
