"""Bad input raises clear errors that name the offending values."""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxhead
from harness.oracle import head_inputs


@pytest.fixture(scope="module")
def data():
    return head_inputs(20, 40, 16, 300)


def test_kept_labels_out_of_range_name_count_and_first_position(data):
    hidden, weight, labels = data
    bad = labels.at[7].set(300).at[9].set(-1).at[2].set(-100)
    keep = jnp.ones(40, bool).at[2].set(False)  # -100 on a skipped token is fine
    with pytest.raises(ValueError, match=r"2 kept label\(s\) outside \[0, 300\); first at "
                       r"position \(7,\) with value 300"):
        jaxhead.token_logprobs(hidden, weight, bad, keep)
    out = jaxhead.token_logprobs(hidden, weight, labels.at[2].set(-100), keep)
    assert np.isfinite(np.asarray(out.logprobs)).all()


def test_batched_label_error_names_multi_dim_position(data):
    hidden, weight, labels = data
    bad = labels.reshape(4, 10).at[3, 1].set(10**6)
    with pytest.raises(ValueError, match=r"position \(3, 1\)"):
        jaxhead.token_logprobs(hidden.reshape(4, 10, 16), weight, bad)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"weight": jnp.zeros((17, 300))}, (r"weight \[17, 300\] with weight_layout='hv' does "
                                            r"not match hidden size 16 \(hidden shape \(40, 16\)\)$")),
        ({"labels": jnp.zeros((41,), jnp.int32)}, r"labels shape \(41,\) must equal hidden shape"),
        ({"keep": jnp.ones((39,), bool)}, r"keep shape \(39,\) != labels shape \(40,\)"),
        ({"temperature": jnp.ones((3,))}, r"temperature must be a scalar or of labels shape"),
        ({"weight": jnp.zeros((16,))},
         r"weight must be \[H, V\] with weight_layout='hv', got shape \(16,\)"),
    ],
)
def test_shape_mismatch_names_both_shapes(data, change, match):
    hidden, weight, labels = data
    kw = {"hidden": hidden, "weight": weight, "labels": labels, "keep": None, "temperature": 1.0}
    kw.update(change)
    with pytest.raises(ValueError, match=match):
        jaxhead.token_logprobs(kw.pop("hidden"), kw.pop("weight"), kw.pop("labels"),
                               kw.pop("keep"), **kw)


def test_dtype_mismatches_name_both_dtypes(data):
    hidden, weight, labels = data
    with pytest.raises(TypeError, match="hidden dtype bfloat16 != weight dtype float32"):
        jaxhead.token_logprobs(hidden.astype(jnp.bfloat16), weight, labels)
    with pytest.raises(TypeError, match="labels must be integer, got float32"):
        jaxhead.token_logprobs(hidden, weight, labels.astype(jnp.float32))
    with pytest.raises(TypeError, match="keep must be bool, got int32"):
        jaxhead.token_logprobs(hidden, weight, labels, jnp.ones(40, jnp.int32))


def test_bucket_smaller_than_kept_count_raises_never_drops(data):
    hidden, weight, labels = data
    keep = jnp.arange(40) % 2 == 0
    with pytest.raises(ValueError, match=r"bucket=8 is smaller than the 20 kept tokens"):
        jaxhead.token_logprobs(hidden, weight, labels, keep, bucket=8)
    out = jaxhead.token_logprobs(hidden, weight, labels, keep, bucket=20)
    assert np.all(np.asarray(out.logprobs)[np.asarray(keep)] < 0)


def test_bad_temperature_softcap_impl(data):
    hidden, weight, labels = data
    with pytest.raises(ValueError, match=r"1 kept temperature\(s\) not > 0; first at position "
                       r"\(5,\) with value 0.0"):
        jaxhead.token_logprobs(hidden, weight, labels, temperature=jnp.ones(40).at[5].set(0.0))
    with pytest.raises(ValueError, match="softcap must be > 0 or None, got -1.0"):
        jaxhead.token_logprobs(hidden, weight, labels, softcap=-1.0)
    with pytest.raises(ValueError, match=r"impl must be 'auto' or one of .* got 'cuda'"):
        jaxhead.token_logprobs(hidden, weight, labels, impl="cuda")
    with pytest.raises(ValueError, match="bucket must be an integer >= 0 known on the host, "
                       "got 2.5"):
        jaxhead.token_logprobs(hidden, weight, labels, jnp.ones(40, bool), bucket=2.5)
    with pytest.raises(ValueError, match="bucket must be an integer >= 0 .* got True"):
        jaxhead.token_logprobs(hidden, weight, labels, bucket=True)  # keep=None: checked too


def test_bucket_is_any_integer_scalar(data):
    """Issue 36: ``bucket=np.int64(16)`` (what ``keep.sum()`` arithmetic gives) was refused."""
    hidden, weight, labels = data
    keep = np.arange(40) % 3 == 0
    want = jaxhead.token_logprobs(hidden, weight, labels, keep, bucket=16)
    for bucket in (np.int64(16), np.int32(16), np.array(16), jnp.asarray(16)):
        got = jaxhead.token_logprobs(hidden, weight, labels, keep, bucket=bucket)
        chex.assert_trees_all_equal(got, want)
    assert jaxhead.bucket_size(np.int64(14), np.int64(40), multiple=np.int32(16)) == 16
    assert jaxhead.bucket_for_shards(keep.reshape(4, 10), np.int64(2), multiple=8) == 8
    with pytest.raises(ValueError, match="num_kept must be an integer >= 0 .* got 3.5"):
        jaxhead.bucket_size(3.5)


def test_errors_cut_long_values(data):
    """Issue 36: labels as a Python list printed the whole list in the error."""
    hidden, weight, labels = data
    as_list = [int(y) for y in np.asarray(labels)] * 1000
    with pytest.raises(TypeError, match=r"labels must be an array .* got \[.*\.\.\. \(list "
                       r"of 40000 items\)") as err:
        jaxhead.token_logprobs(hidden, weight, as_list)
    assert len(str(err.value)) < 200
    with pytest.raises(TypeError, match="keep must be an array") as err:
        jaxhead.token_logprobs(hidden, weight, labels, [True] * 40)
    assert len(str(err.value)) < 200
    with pytest.raises(ValueError, match=r"bucket must be .* \(list of 5000 items\)"):
        jaxhead.token_logprobs(hidden, weight, labels, bucket=[1] * 5000)


def _next_token_case():
    """``(hidden, weight, labels, valid, want)``: two rows of 4 tokens, their next-token
    labels (-100 where there is none) and the log-probs of the valid ones."""
    tokens = jnp.asarray([[5, 6, 7, 8], [1, 2, 3, 4]])
    hidden = jax.random.normal(jax.random.key(0), (2, 4, 8))
    weight = jax.random.normal(jax.random.key(1), (8, 16))
    labels, valid = jaxhead.next_token_labels(tokens)
    return hidden, weight, labels, valid, jaxhead.token_logprobs(hidden, weight, labels, valid)


def test_lm_head_and_the_reference_ignore_the_ignore_index():
    """Issue 36: ``LMHead.__call__`` / ``.sharded`` had no ``ignore_index`` and
    ``reference_token_logprobs`` raised on the -100 labels ``token_logprobs`` skips."""
    hidden, weight, labels, valid, want = _next_token_case()
    ref = jaxhead.reference_token_logprobs(hidden, weight, labels)
    chex.assert_trees_all_close(ref, want, atol=1e-5)
    jitted = jax.jit(lambda y: jaxhead.reference_token_logprobs(hidden, weight, y))(labels)
    chex.assert_trees_all_close(jitted, want, atol=1e-5)
    with pytest.raises(ValueError, match="2 kept label"):
        jaxhead.reference_token_logprobs(hidden, weight, labels, ignore_index=None)
    head = jaxhead.LMHead(8, 16, rngs=nnx.Rngs(0))
    head.kernel[...] = weight
    chex.assert_trees_all_close(head(hidden, labels), want, atol=1e-6)
    mesh = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1])
    chex.assert_trees_all_close(head.sharded(hidden, labels, mesh=mesh, token_axes=("data",)),
                                want, atol=1e-6)
    with pytest.raises(ValueError, match="2 kept label"):
        head(hidden, labels, ignore_index=None)
    labels_7 = jnp.where(valid, labels, -7)
    chex.assert_trees_all_close(head(hidden, labels_7, ignore_index=-7), want, atol=1e-6)


def test_ignore_index_labels_are_not_kept_without_a_keep_mask():
    """Labels from ``next_token_labels`` (-100 where there is no next token) work with
    ``keep=None``, eagerly and under ``jit``: those positions are 0, as in PyTorch's
    cross-entropy; another out-of-range label still raises; ``ignore_index=None`` keeps all."""
    hidden, weight, labels, valid, want = _next_token_case()
    got = jaxhead.token_logprobs(hidden, weight, labels)
    chex.assert_trees_all_close(got, want, atol=1e-6)
    jitted = jax.jit(lambda h, y: jaxhead.token_logprobs(h, weight, y))(hidden, labels)
    chex.assert_trees_all_close(jitted, want, atol=1e-6)
    with pytest.raises(ValueError, match=r"1 kept label\(s\) outside \[0, 16\); first at "
                       r"position \(0, 1\) with value -7"):
        jaxhead.token_logprobs(hidden, weight, labels.at[0, 1].set(-7))
    with pytest.raises(ValueError, match="2 kept label"):
        jaxhead.token_logprobs(hidden, weight, labels, ignore_index=None)
    # traced labels, no bucket: rows run in order (no [N, H] gather/scatter), outputs and
    # gradients exactly 0 on the ignored rows; with a bucket, compacted: same numbers
    def loss(h, w, y, bucket=None):
        out = jaxhead.token_logprobs(h, w, y, bucket=bucket)
        return jnp.sum(out.logprobs) + 0.3 * jnp.sum(out.entropy), out

    for bucket in (None, 4):
        (_, out), (dh, dw) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True),
                                     static_argnums=3)(hidden, weight, labels, bucket)
        chex.assert_trees_all_close(out, want, atol=1e-6)
        def explicit(h, w):
            o = jaxhead.token_logprobs(h, w, labels, valid)
            return jnp.sum(o.logprobs) + 0.3 * jnp.sum(o.entropy)

        dh_want, dw_want = jax.grad(explicit, (0, 1))(hidden, weight)
        assert np.all(np.asarray(dh)[:, -1] == 0), bucket
        chex.assert_trees_all_close((dh, dw), (dh_want, dw_want), atol=1e-5)


def test_a_weight_in_the_other_layout_is_named():
    hidden, labels = jnp.ones((3, 2)), jnp.zeros(3, jnp.int32)
    with pytest.raises(ValueError, match=r"weight \[16, 2\] with weight_layout='hv' does not "
                       r"match hidden size 2 .*; a \[V, H\] weight \(e.g. a tied embedding "
                       r"table\) needs weight_layout='vh'"):
        jaxhead.token_logprobs(hidden, jnp.ones((16, 2)), labels)
    with pytest.raises(ValueError, match=r"weight \[2, 16\] with weight_layout='vh' does not "
                       r"match hidden size 2 .*; a \[H, V\] weight needs weight_layout='hv'"):
        jaxhead.token_logprobs(hidden, jnp.ones((2, 16)), labels, weight_layout="vh")


def test_traced_keep_without_a_bucket_warns_with_the_fix():
    hidden, weight = jnp.ones((4, 8)), jnp.ones((8, 16))
    labels, keep = jnp.arange(4), jnp.asarray([True, False, True, False])
    with pytest.warns(UserWarning, match=r"keep is traced and bucket is None.*bucket_size"):
        jax.jit(lambda k: jaxhead.token_logprobs(hidden, weight, labels, k).logprobs)(keep)
