"""Hostile inputs to the functional API and the models, one table: each is a named
ValueError/TypeError at trace time, or a documented exact result, never a silent wrong
value, a NaN or an internal error. Sizes are distinct per axis (B 2, T 5, S 7, N 6, K 3,
H 4, V 11)."""

import functools

import flax.linen
import flax.nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import attnjax
import attnjax.nnx
from attnjax import kv_cache, masks, nn, scores
from attnjax.parallel import context, ring
from tests import draws

B, T, S, N, K, H, V = 2, 5, 7, 6, 3, 4, 11
q, k, v = draws.normals(0, (B, T, N, H), (B, S, K, H), (B, S, K, V))
dpa = attnjax.dot_product_attention
LENGTHS = np.array([S, 3], np.int32)   # example 1's keys 3.. are padding


# attnjax's own checks, as a user without runtime type checks meets them
pytestmark = pytest.mark.usefixtures("own_checks_only")


def _zeros(*shape):
    return jnp.zeros(shape, jnp.float32)


def _without_x64(fn, *args):
    """fn(*args) as most users run jax, without 64-bit types (the suite enables them)."""
    with jax.enable_x64(False):
        return fn(*args)


@functools.cache
def _decoder(positional="learned"):
    model = nn.DecoderOnly(nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2,
                                                d_ff=24, max_len=8, positional=positional),
                           deterministic=True)
    return model, jax.jit(model.init)(jax.random.key(5), jnp.ones((1, 4), jnp.int32))["params"]


@functools.cache
def _transformer():
    model = nn.Transformer(nn.TransformerConfig(src_vocab_size=7, tgt_vocab_size=9, d_model=16,
                                                num_heads=2, d_ff=24, max_len=8,
                                                positional="learned"), deterministic=True)
    tokens = jnp.ones((1, 3), jnp.int32)
    return model, jax.jit(model.init)(jax.random.key(6), tokens, tokens)["params"]


def _apply_decoder(tokens, **kw):
    model, params = _decoder()
    return model.apply({"params": params}, jnp.asarray(tokens, jnp.int32), **kw)


def _decode_step(tokens, positions):
    """One call of the decode=True model on a cache init sized, at given positions."""
    model, params = _decoder()
    decoder = model.clone(decode=True)
    tokens = jnp.asarray(tokens, jnp.int32)
    cache = decoder.init(jax.random.key(0), tokens)["cache"]
    return decoder.apply({"params": params, "cache": cache}, tokens, positions=positions,
                         mutable=["cache"])


def _generate(prompt, **kw):
    model, params = _decoder()
    return nn.generate(model, params, jnp.asarray(prompt, jnp.int32), **kw)


def _greedy(**kw):
    model, params = _transformer()
    kw = {"max_len": 4, "bos_id": 1, "eos_id": 2} | kw
    return nn.greedy_decode(model, params, jnp.ones((1, 3), jnp.int32), **kw)


def _mesh():
    return Mesh(np.asarray(jax.devices()[:4]), ("seq",))


def _ring_in_shard_map(query, key, value, check_vma=False, **kw):
    spec = PartitionSpec(None, "seq", None, None)
    return jax.shard_map(functools.partial(ring.ring_attention, **kw), mesh=_mesh(),
                         in_specs=(spec,) * 3, out_specs=spec,
                         check_vma=check_vma)(query, key, value)


q8 = draws.normal(7, (B, 8, 2, H))
TOKENS = np.array([[3, 4, 5, 6]], np.int32)

# (id, call, exception, regex the message must match)
MISTAKES = [
    # scale: absurd or non-finite values are refused, not turned into NaN
    ("scale_1e300", lambda: dpa(q, k, v, scale=1e300), ValueError,
     r"scale must lie in \[1.18e-38, 10000\].*got 1e\+300"),
    ("scale_tiny", lambda: dpa(q, k, v, scale=1e-300), ValueError, r"scale must lie in.*1e-300"),
    ("scale_inf", lambda: dpa(q, k, v, scale=float("inf")), ValueError,
     r"scale must be positive and finite; got inf"),
    ("scale_nan", lambda: dpa(q, k, v, scale=float("nan")), ValueError,
     r"scale must be positive and finite; got nan"),
    ("scale_core", lambda: attnjax.attention(q[0, :, 0], k[0, :, 0], v[0, :, 0], scale=1e300),
     ValueError, r"scale must lie in"),
    # bias: NaN and +inf known outside jit (-inf is a mask, allowed)
    ("bias_inf", lambda: dpa(q, k, v, bias=_zeros(B, N, T, S).at[1, 2, 3, 4].set(jnp.inf)),
     ValueError, r"bias must be finite or -inf \(masked\); got inf at index \[1, 2, 3, 4\]"),
    ("bias_nan", lambda: dpa(q, k, v, bias=_zeros(T, S).at[0, 6].set(jnp.nan)), ValueError,
     r"bias must be finite or -inf \(masked\); got nan at index \[0, 6\]"),
    # lengths, segment ids and positions that int32 cannot hold
    ("lengths_uint32", lambda: dpa(q, k, v, key_lengths=np.array([2**32 - 1, 3], np.uint32)),
     ValueError, r"key lengths must lie in int32's range .*got 4294967295 \(dtype uint32\)"),
    ("lengths_int64", lambda: dpa(q, k, v, query_lengths=np.array([2**32 + 2, 3], np.int64)),
     ValueError, r"query lengths must lie in int32's range .*got 4294967298 \(dtype int64\)"),
    ("segments_int64", lambda: dpa(q, k, v, mask=masks.segments(
        np.full((B, T), -2**40, np.int64), np.zeros((B, S), np.int64))), ValueError,
     r"segment ids \(query\) must lie in int32's range .*got -1099511627776"),
    ("positions_uint64", lambda: dpa(q, k, v, is_causal=True, positions=(
        np.arange(T, dtype=np.uint64) + 2**63, np.arange(S, dtype=np.uint64))), ValueError,
     r"query positions must lie in int32's range"),
    # lengths that count no position: refused when known (under jit, none, as 0)
    ("lengths_negative", lambda: dpa(q, k, v, key_lengths=np.array([3, -2])), ValueError,
     r"key lengths must be non-negative \(a number of positions\); got -2"),
    ("prefix_negative", lambda: dpa(q, k, v, mask=masks.causal() | masks.prefix(-1)),
     ValueError, r"prefix length must be non-negative \(a number of positions\); got -1"),
    # empty axes
    ("empty_batch", lambda: dpa(q[:0], k[:0], v[:0]), ValueError,
     r"query, key and value must not be empty; got B=0 in query \[0, 5, 6, 4\]"),
    ("empty_queries", lambda: dpa(q[:, :0], k, v, implementation="chunked"), ValueError,
     r"must not be empty; got T=0"),
    ("empty_keys", lambda: dpa(q, k[:, :0], v[:, :0]), ValueError, r"must not be empty; got S=0"),
    ("empty_head_dim", lambda: dpa(q[..., :0], k[..., :0], v), ValueError,
     r"must not be empty; got H=0"),
    ("empty_heads", lambda: dpa(q[:, :, :0], k[:, :, :0], v[:, :, :0]), ValueError,
     r"must not be empty; got N=0, K=0"),
    ("empty_unbatched", lambda: dpa(q[0, :0], k[0], v[0]), ValueError,
     r"must not be empty; got T=0 in query \[0, 6, 4\] \[T, N, H\]"),
    # token ids and learned positions, known outside jit
    ("token_minus_one", lambda: _apply_decoder([[3, -1, 5]]), ValueError,
     r"tokens must hold token ids in \[0, 13\) \(the vocabulary\); got -1"),
    ("token_past_vocab", lambda: _apply_decoder([[3, 13, 5]]), ValueError,
     r"tokens must hold token ids in \[0, 13\).*got 13"),
    ("token_float", lambda: _apply_decoder_float(), TypeError,
     r"tokens must hold integer token ids; got dtype float32"),
    ("src_token", lambda: _transformer()[0].apply({"params": _transformer()[1]},
                                                  jnp.array([[1, 7]]), jnp.array([[1]])),
     ValueError, r"src must hold token ids in \[0, 7\)"),
    ("tgt_token", lambda: _transformer()[0].apply({"params": _transformer()[1]},
                                                  jnp.array([[1, 2]]), jnp.array([[9]])),
     ValueError, r"tgt must hold token ids in \[0, 9\)"),
    ("learned_too_long", lambda: _apply_decoder(np.ones((1, 9), np.int32)), ValueError,
     r"tokens has 9 tokens, more than the max_len=8 learned positions"),
    ("learned_positions", lambda: _apply_decoder(TOKENS, positions=jnp.array([[0, 1, 2, 8]])),
     ValueError, r"the positions of tokens must lie in \[0, 8\).*got 8"),
    # decoding too (negative positions are generate's padding slots), where they had read
    # the table's last row
    ("decode_learned_positions", lambda: _decode_step(TOKENS, jnp.array([[-1, 0, 1, 20]])),
     ValueError, r"the positions of tokens must lie in \[0, 8\).*got 20"),
    # the user's functions with the wrong arguments, named before anything is traced
    ("score_mod_arguments", lambda: dpa(q, k, v, score_mod=lambda s: s,
                                        implementation="chunked"), TypeError,
     r"score_mod must take 5 positional arguments, score_mod\(score, b, n, q_pos, k_pos\); "
     r"got <lambda>\(s\)"),
    ("from_fn_arguments", lambda: masks.from_fn(lambda q_pos, k_pos: q_pos >= k_pos),
     TypeError, r"from_fn's fn must take 4 positional arguments, fn\(b, n, q_pos, k_pos\)"),
    ("soft_cap_string", lambda: scores.soft_cap("30"), TypeError,
     r"soft_cap's cap must be a number .*; got str"),
    # dense masks and the inputs' own dtype
    ("combine_masks_shapes", lambda: masks.combine_masks(np.ones((3, 3), bool),
                                                         np.ones((4, 4), bool)), ValueError,
     r"combine_masks needs masks that broadcast together; got shapes \[3, 3\], \[4, 4\]"),
    ("causal_mask_negative", lambda: masks.causal_mask(-1), ValueError,
     r"num_queries must be a positive int; got -1"),
    ("query_int64", lambda: _without_x64(dpa, np.ones((B, T, N, H), np.int64), k, v),
     TypeError, r"query must have a floating dtype; got int64"),   # (was "int32")
    # kv_cache.append called directly: the values as the keys and the cache, a known index
    # (a short value had left a filled slot stale, a negative index wrote the last slots)
    ("append_value_length", lambda: kv_cache.append(
        _zeros(1, 6, 2, 3), _zeros(1, 6, 2, 4), 0, _zeros(1, 2, 2, 3), _zeros(1, 1, 2, 4)),
     ValueError, r"new values must have the keys' batch axes, T and heads and the cache's "
                 r"V, \[batch..., T, K, V\] = \[1, 2, 2, 4\]; got \[1, 1, 2, 4\]"),
    ("append_value_width", lambda: kv_cache.append(
        _zeros(1, 6, 2, 3), _zeros(1, 6, 2, 4), 0, _zeros(1, 2, 2, 3), _zeros(1, 2, 2, 5)),
     ValueError, r"= \[1, 2, 2, 4\]; got \[1, 2, 2, 5\]"),
    ("append_negative_index", lambda: kv_cache.append(
        _zeros(1, 6, 1, 2), _zeros(1, 6, 1, 2), -1, _zeros(1, 2, 1, 2), _zeros(1, 2, 1, 2)),
     ValueError, r"the cache index must be >= 0 \(the first free slot\); got -1"),
    ("append_float_index", lambda: kv_cache.append(
        _zeros(1, 6, 1, 2), _zeros(1, 6, 1, 2), 1.5, _zeros(1, 2, 1, 2), _zeros(1, 2, 1, 2)),
     TypeError, r"the cache index must be an int \(a slot\); got 1.5"),
    # a score_mod made for another number of query heads (it read the last head's values)
    ("alibi_heads", lambda: dpa(q, k, v, score_mod=scores.alibi(scores.alibi_slopes(4))),
     ValueError, r"score_mod holds values for 4 query heads .*; got N=6 query heads"),
    ("relative_bias_heads", lambda: dpa(q, k, v, score_mod=scores.relative_position_bias(
        _zeros(32, 2))), ValueError, r"score_mod holds values for 2 query heads"),
    ("chained_heads", lambda: dpa(q, k, v, score_mod=scores.chain(
        scores.soft_cap(5.0), scores.alibi(scores.alibi_slopes(3)))), ValueError,
     r"score_mod holds values for 3 query heads .*; got N=6"),
    ("chain_of_two_head_counts", lambda: scores.chain(
        scores.alibi(scores.alibi_slopes(6)), scores.relative_position_bias(_zeros(32, 2))),
     ValueError, r"chain's score_mods hold values for different numbers of query heads: "
                 r"\[2, 6\]"),
    # decoding
    ("generate_negative", lambda: _generate(TOKENS, max_new_tokens=-1), ValueError,
     r"max_new_tokens must be an int >= 0; got -1"),
    ("generate_past_max_len", lambda: _generate(TOKENS, max_new_tokens=6), ValueError,
     r"prompt length 4 \+ max_new_tokens=6 - 1 \(the model reads every new token but the "
     r"last\) exceeds the model's max_len=8"),
    ("generate_token", lambda: _generate([[3, 20]], max_new_tokens=2), ValueError,
     r"prompt must hold token ids in \[0, 13\) \(the vocabulary\); got 20"),
    ("generate_temperature", lambda: _generate(TOKENS, max_new_tokens=2, temperature=-1.0),
     ValueError, r"temperature must be a finite number >= 0; got -1.0"),
    ("generate_lengths", lambda: _generate(TOKENS, prompt_lengths=jnp.array([5]),
                                           max_new_tokens=2), ValueError,
     r"prompt_lengths must lie in \[1, 4\]; got 5"),
    ("generate_empty", lambda: _generate(np.zeros((1, 0), np.int32), max_new_tokens=2),
     ValueError, r"prompt must be a non-empty int array \[B, L\]; got shape \(1, 0\)"),
    ("greedy_max_len", lambda: _greedy(max_len=0), ValueError,
     r"max_len must be an int >= 1; got 0"),
    ("greedy_bos", lambda: _greedy(bos_id=9), ValueError, r"bos_id must be a token id in \[0, 9\)"),
    # a switch is a bool: "false" would be true, a traced one cannot choose the program
    ("is_causal_str", lambda: dpa(q, k, v, is_causal="false"), TypeError,
     r"is_causal must be a bool \(True or False\); got 'false'"),
    ("is_causal_traced", lambda: jax.jit(lambda c: dpa(q, k, v, is_causal=c))(True),
     TypeError, r"is_causal must be a bool \(True or False\); got a traced value: under "
                r"jax.jit, make it a static argument"),
    ("return_weights_none", lambda: dpa(q, k, v, return_weights=None), TypeError,
     r"return_weights must be a bool \(True or False\); got None"),
    ("from_fn_shape", lambda: dpa(q, k, v, mask=masks.from_fn(
        lambda b, n, q_pos, k_pos: (q_pos >= k_pos)[..., None])), ValueError,
     r"from_fn's function must return one boolean per query and key: a shape that "
     r"broadcasts with q_pos \[5, 1\] and k_pos \[1, 7\] to \[5, 7\]; got \[5, 7, 1\]"),
    # ring attention validates like dot_product_attention
    ("ring_axis", lambda: ring.ring_self_attention(q8, q8, q8, _mesh(), axis="sequence"),
     ValueError, r"axis='sequence' is not an axis of the mesh; its axes are \('seq',\)"),
    # (jax's "cond branches must have equal output types" had named nothing)
    ("ring_check_vma", lambda: _ring_in_shard_map(q8, q8, q8, check_vma=True, axis_name="seq"),
     ValueError, r"ring_attention runs inside jax.shard_map\(..., check_vma=False\); got "
                 r"arrays typed as varying over \['seq'\]"),
    ("ring_axis_name", lambda: _ring_in_shard_map(q8, q8, q8, axis_name="nope"), ValueError,
     r"axis_name='nope' is not an axis of an enclosing jax.shard_map"),
    ("ring_int32", lambda: ring.ring_self_attention(q8.astype(jnp.int32), q8.astype(jnp.int32),
                                                    q8.astype(jnp.int32), _mesh()),
     TypeError, r"query must have a floating dtype; got int32"),
    ("ring_scale", lambda: _ring_in_shard_map(q8, q8, q8, axis_name="seq", scale=1e300),
     ValueError, r"scale must lie in"),
    ("ring_empty", lambda: _ring_in_shard_map(q8[..., :0], q8[..., :0], q8, axis_name="seq"),
     ValueError, r"must not be empty; got H=0"),
    ("ring_is_causal", lambda: ring.ring_self_attention(q8, q8, q8, _mesh(), is_causal="no"),
     TypeError, r"is_causal must be a bool \(True or False\); got 'no'"),
    ("ring_attention_is_causal", lambda: _ring_in_shard_map(q8, q8, q8, axis_name="seq",
                                                            is_causal=None),
     TypeError, r"is_causal must be a bool \(True or False\); got None"),
    ("module_is_causal", lambda: nn.MultiHeadDotProductAttention(num_heads=2, is_causal="no").init(
        jax.random.key(0), jnp.ones((1, 3, 4), jnp.float32)),
     TypeError, r"is_causal must be a bool \(True or False\); got 'no'"),
    ("ring_key_length", lambda: ring.ring_self_attention(q8, q8[:, :4], q8[:, :4], _mesh()),
     ValueError, r"self-attention needs key of the query's \[B, T\] = \[2, 8\]"),
    # not one key: a number, floats, a batch of keys (jax's own errors had named no
    # argument)
    ("dropout_rng_int", lambda: dpa(q, k, v, dropout_rate=0.5, dropout_rng=3),
     TypeError, r"dropout_rng must be one jax.random key .*; got int 3"),
    ("dropout_rng_floats", lambda: dpa(q, k, v, dropout_rate=0.5, dropout_rng=_zeros(2)),
     TypeError, r"dropout_rng must be one jax.random key .*; got float32 of shape \[2\]"),
    ("dropout_rng_keys", lambda: dpa(q, k, v, dropout_rate=0.5, dropout_broadcast=True,
                                     dropout_rng=jax.random.split(jax.random.key(0), 3)),
     TypeError, r"dropout_rng must be one jax.random key .*; got keys of shape \[3\]"),
    # the modules' dropout_rate, also where nothing is dropped (it had run as 0)
    ("module_dropout_rate", lambda: nn.MultiHeadDotProductAttention(
        num_heads=2, dropout_rate=-0.1, deterministic=False).init(
        jax.random.key(0), jnp.ones((1, 3, 4), jnp.float32)),
     ValueError, r"dropout_rate must lie in \[0, 1\]; got -0.1"),
    ("nnx_dropout_rate", lambda: attnjax.nnx.MultiHeadAttention(
        2, 4, dropout_rate=float("nan"), decode=False, rngs=flax.nnx.Rngs(0)),
     ValueError, r"dropout_rate must lie in \[0, 1\]; got nan"),
    # flax's attention functions take one key/value head per query head (flax's
    # AssertionError had named nothing)
    ("module_attention_fn_kv_heads", lambda: nn.MultiHeadDotProductAttention(
        num_heads=4, num_kv_heads=2, attention_fn=flax.linen.dot_product_attention).init(
        jax.random.key(0), jnp.ones((1, 3, 8), jnp.float32)),
     ValueError, r"takes as many key/value heads as query heads; got num_kv_heads=2 for "
                 r"num_heads=4"),
    # a learned alignment with a kernel that cannot run it: named where the module is
    # made or first called (it had been found in the engine, naming its score_fn)
    ("module_learned_score_kernel", lambda: nn.MultiHeadAttention(
        num_heads=2, score="general", implementation="chunked").init(
        jax.random.key(0), jnp.ones((1, 3, 4), jnp.float32)),
     ValueError, r"score='general' is a learned alignment, which runs on "
                 r"implementation='dense' \(or None\); got implementation='chunked'"),
    ("nnx_learned_score_kernel", lambda: attnjax.nnx.MultiHeadAttention(
        2, 4, score="additive", implementation="cudnn", decode=False, rngs=flax.nnx.Rngs(0)),
     ValueError, r"score='additive' is a learned alignment, .*; got implementation='cudnn'"),
    # an nnx cache longer than the learned positions (its tokens past them had all been
    # encoded at the last)
    ("nnx_cache_past_learned_positions", lambda: attnjax.nnx.DecoderOnly(
        nn.DecoderOnlyConfig(vocab_size=13, d_model=16, num_heads=2, d_ff=24, max_len=8,
                             positional="learned"), decode=True,
        rngs=flax.nnx.Rngs(0)).init_cache(1, 9),
     ValueError, r"max_length=9 exceeds the model's max_len=8 learned positions"),
    # kv_cache.append: a float index traced (lax's own TypeError before), cached values
    # not the cached keys' shape (accepted), new keys in another dtype than the cache
    # (cast, then refused by the attention naming the query's dtype against the key's)
    ("append_traced_float_index", lambda: jax.jit(lambda i: kv_cache.append(
        _zeros(1, 6, 1, 2), _zeros(1, 6, 1, 2), i, _zeros(1, 2, 1, 2), _zeros(1, 2, 1, 2)))(
            1.5), TypeError, r"the cache index must be an int \(a slot\); got a traced float"),
    ("append_cached_value_length", lambda: kv_cache.append(
        _zeros(2, 6, 1, 2), _zeros(2, 5, 1, 3), 0, _zeros(2, 1, 1, 2), _zeros(2, 1, 1, 3)),
     ValueError, r"the cached values must have the cached keys' batch axes, length and heads, "
                 r"\[batch..., L, K, V\] = \[2, 6, 1, V\]; got \[2, 5, 1, 3\]"),
    ("append_dtype", lambda: kv_cache.append(
        _zeros(1, 6, 1, 2), _zeros(1, 6, 1, 2), 0, _zeros(1, 1, 1, 2).astype(jnp.bfloat16),
        _zeros(1, 1, 1, 2).astype(jnp.bfloat16)),
     TypeError, r"the new keys are bfloat16 but the cache holds float32: make the cache in "
                r"the keys' dtype \(attnjax.nnx: init_cache\(..., dtype=bfloat16\)\)"),
    ("nnx_cache_dtype", lambda: _nnx_bf16_step_on_a_float32_cache(), TypeError,
     r"the new keys are bfloat16 but the cache holds float32: .*init_cache\(..., "
     r"dtype=bfloat16\)"),
    # multi_head_attention's parameters: a None bias (AttributeError before)
    ("mha_bias_none", lambda: attnjax.multi_head_attention(
        {**_mha_params(), "query": {**_mha_params()["query"], "bias": None}}, q[..., 0, :]),
     TypeError, r"params\['query'\]\['bias'\] must be an array, or a list of numbers of one "
                r"shape; got NoneType"),
    # a bias that is not floating (jax.nn adds any dtype): named with what to pass instead
    ("bias_int", lambda: dpa(q, k, v, bias=draws.randint(8, (T, S), -3, 3)), TypeError,
     r"bias must be a floating array \(additive logits\); got int32: cast it "
     r"\(bias.astype\(jnp.float32\)\)"),
    ("bias_bool", lambda: dpa(q, k, v, bias=draws.randint(9, (T, S), 0, 2) > 0), TypeError,
     r"bias must be a floating array \(additive logits\); got bool: a bool array is a mask "
     r"\(mask=\)"),
    ("query_none", lambda: dpa(None, k, v),
     TypeError, r"query must be an array, or a list of numbers of one shape; got NoneType"),
    ("value_str", lambda: dpa(q, k, "abc"),
     TypeError, r"value must be an array, or a list of numbers of one shape; got str abc"),
    # switches that took any truthy value: "no" turned sinks, biases, decoding on
    ("linen_switch_string", lambda: nn.MultiHeadDotProductAttention(
        num_heads=2, use_sinks="no").init(jax.random.key(0), q[:, :, 0]),
     TypeError, r"use_sinks must be a bool \(True or False\); got 'no'"),
    ("linen_decode_string", lambda: nn.MultiHeadDotProductAttention(
        num_heads=2, decode="no").init(jax.random.key(0), q[:, :, 0]),
     TypeError, r"decode must be a bool \(True or False\); got 'no'"),
    ("nnx_switch_string", lambda: attnjax.nnx.MultiHeadAttention(
        2, H, use_bias="no", rngs=flax.nnx.Rngs(0)),
     TypeError, r"use_bias must be a bool \(True or False\); got 'no'"),
    ("init_mha_switch_string", lambda: attnjax.init_multi_head_attention(
        jax.random.key(0), H, 2, use_bias="no"),
     TypeError, r"use_bias must be a bool \(True or False\); got 'no'"),
    ("relative_bias_switch_string", lambda: scores.relative_position_bias(
        _zeros(32, N), bidirectional="no"),
     TypeError, r"bidirectional must be a bool \(True or False\); got 'no'"),
    # positions of another length than the tokens: jax's broadcasting error before
    ("decoder_positions_length", lambda: _apply_decoder(
        [[3, 4, 5]], positions=jnp.arange(4, dtype=jnp.int32)[None]),
     ValueError, r"the positions of tokens must broadcast to its shape \[1, 3\]; got "
                 r"\[1, 4\]"),
    # the encoder-decoder's src_lengths: negative ones accepted, a wrong shape named
    # query lengths
    ("transformer_src_lengths_negative", lambda: _apply_transformer(src_lengths=[-1]),
     ValueError, r"src_lengths must lie in \[0, inf\] \(the source \[B, S\] = \[1, 3\]\); "
                 r"got -1"),
    ("transformer_src_lengths_shape", lambda: _apply_transformer(src_lengths=[2, 3]),
     ValueError, r"src_lengths must have shape \[B\] = \(1,\) or \(\) \(the source \[B, S\] "
                 r"= \[1, 3\]\); got \(2,\)"),
    # masked_softmax: an additive mask inverted silently; jax's errors for the rest
    ("masked_softmax_additive_mask", lambda: attnjax.masked_softmax(
        _zeros(T, S), jnp.where(draws.randint(10, (T, S), 0, 2) > 0, 0.0, -jnp.inf).astype(
            jnp.float32)),
     ValueError, r"mask is flax's: bool, or float/int where nonzero attends .*got -inf"),
    ("masked_softmax_mask_transposed", lambda: attnjax.masked_softmax(
        _zeros(T, S), jnp.ones((S, T), bool)),
     ValueError, r"mask must broadcast with logits \[5, 7\]; got \[7, 5\]"),
    ("masked_softmax_rank_1", lambda: attnjax.masked_softmax(_zeros(S)),
     ValueError, r"logits must have rank 2 or more \(\[..., T, S\]\); got shape \[7\]"),
    # a module's float mask is flax's (nonzero attends): an additive one was inverted
    ("module_additive_mask", lambda: _mha_module_call(mask=jnp.where(
        jnp.tril(jnp.ones((T, T), bool)), 0.0, -1e9)),
     ValueError, r"mask is flax's: bool, or float/int where nonzero attends .*got -1000000000"
                 r".*an additive mask goes in bias="),
    ("padding_mask_negative", lambda: masks.padding_mask(jnp.array([-1, 3]), 4),
     ValueError, r"lengths must be non-negative \(a number of positions\); got -1"),
    ("query_key_mask_batches", lambda: masks.query_key_mask(
        jnp.array([1, 2]), jnp.array([1, 2, 3]), 4, 4),
     ValueError, r"query_lengths and key_lengths must have one length an example, \[B\] "
                 r"alike; got \[2\] and \[3\]"),
    ("combine_masks_of_a_mask", lambda: masks.combine_masks(masks.causal(),
                                                            np.ones((3, 3), bool)),
     TypeError, r"combine_masks combines boolean arrays; got a Mask as masks\[0\]"),
    ("core_attention_no_keys", lambda: attnjax.attention(q[0, :, 0], k[0, :0, 0], v[0, :0, 0]),
     ValueError, r"k must hold at least one key; got S=0 in k \[0, 4\] \[S, H\]"),
    # what the user's functions return, and chain's functions: jax's errors before
    ("score_mod_returns_a_tuple", lambda: dpa(q, k, v, score_mod=lambda s, b, n, i, j: (s, s)),
     TypeError, r"score_mod must return an array of scores, the score's shape \[5, 7\]; "
                r"got tuple"),
    ("from_fn_returns_none", lambda: dpa(q, k, v, mask=masks.from_fn(lambda b, n, i, j: None)),
     TypeError, r"from_fn's function must return an array of booleans; got NoneType"),
    ("chain_of_one_argument", lambda: scores.chain(lambda s: s),
     TypeError, r"chain's argument 0 must take 5 positional arguments, score_mod\(score, b, n, "
                r"q_pos, k_pos\)"),
    # a model given the other model's config, nnx's rngs not an Rngs: AttributeErrors
    ("linen_decoder_of_a_transformer_config", lambda: nn.DecoderOnly(
        _transformer()[0].config).init(jax.random.key(0), jnp.ones((1, 3), jnp.int32)),
     TypeError, r"DecoderOnly takes a DecoderOnlyConfig; got TransformerConfig"),
    ("nnx_decoder_of_a_transformer_config", lambda: attnjax.nnx.DecoderOnly(
        _transformer()[0].config, rngs=flax.nnx.Rngs(0)),
     TypeError, r"DecoderOnly takes a DecoderOnlyConfig; got TransformerConfig"),
    ("nnx_rngs_int", lambda: attnjax.nnx.MultiHeadAttention(2, H, rngs=0),
     TypeError, r"rngs must be an nnx.Rngs \(nnx.Rngs\(0\), say\); got int"),
    # a cache sized by init_cache((B, L)), the features axis forgotten (its last axis is
    # not read, as in flax): the error names init_cache's argument
    ("nnx_init_cache_without_features", lambda: _nnx_step_after_init_cache((B, T)),
     ValueError, r"new keys must have the cache's batch axes and heads.*attnjax.nnx's "
                 r"init_cache takes their whole shape"),
    ("nnx_init_cache_negative", lambda: attnjax.nnx.MultiHeadAttention(
        2, H, decode=True, rngs=flax.nnx.Rngs(0)).init_cache((B, -1, H)),
     ValueError, r"input_shape must be the inputs' shape \[batch..., L, features\] \(positive "
                 r"ints, as x.shape\); got \(2, -1, 4\)"),
    ("lay_out_zero_shards", lambda: context.lay_out(np.ones((B, 8)), 0),
     ValueError, r"num_shards must be a positive int \(the devices of the sequence axis\); "
                 r"got 0"),
]


def _nnx_step_after_init_cache(input_shape):
    layer = attnjax.nnx.MultiHeadAttention(2, H, decode=True, is_causal=True,
                                           rngs=flax.nnx.Rngs(0))
    layer.init_cache(input_shape)
    return layer(q[:, :1, 0])


def _apply_transformer(src_lengths):
    model, params = _transformer()
    tokens = jnp.ones((1, 3), jnp.int32)
    return model.apply({"params": params}, tokens, tokens, jnp.asarray(src_lengths))


def _mha_module_call(mask):
    layer = nn.MultiHeadDotProductAttention(num_heads=2)
    x = q[:, :, 0]   # [B, T, H]
    return layer.apply(layer.init(jax.random.key(0), x), x, mask=mask)


def _nnx_bf16_step_on_a_float32_cache():
    layer = attnjax.nnx.MultiHeadAttention(2, H, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                           decode=True, rngs=flax.nnx.Rngs(0))
    layer.init_cache((B, T, H))   # float32, init_cache's default
    return layer(q[:, :1, 0].astype(jnp.bfloat16))


@functools.cache
def _mha_params():
    return attnjax.init_multi_head_attention(jax.random.key(7), H, 2)


def _apply_decoder_float():
    model, params = _decoder()
    return model.apply({"params": params}, jnp.ones((1, 3), jnp.float32))


@pytest.mark.parametrize("call, error, message", [m[1:] for m in MISTAKES],
                         ids=[m[0] for m in MISTAKES])
def test_hostile_input_is_a_named_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize("implementation", [None, "dense", "chunked"])
def test_symbolic_dimensions_of_jax_export_are_a_named_error(implementation):
    """jax.export's shape polymorphism: attnjax plans its kernels from the sizes, and
    a symbolic batch or length had been jax's "inconclusive" comparison deep inside."""
    for dims in ("b, 6, 4, 8", "2, t, 4, 8"):
        spec = jax.ShapeDtypeStruct(jax.export.symbolic_shape(dims), jnp.float32)
        call = jax.jit(lambda q: attnjax.dot_product_attention(
            q, q, q, is_causal=True, implementation=implementation))
        with pytest.raises(ValueError, match=r"query must have concrete dimensions; got "
                                             rf"\[{dims}\], symbolic"):
            jax.export.export(call)(spec)


def test_soft_cap_takes_a_numpy_or_jax_number():
    """(a jnp.float32 cap was refused as not positive)"""
    assert scores.soft_cap(jnp.float32(30.0)) is scores.soft_cap(np.float64(30.0))
    assert scores.soft_cap(np.int32(30)) is scores.soft_cap(30.0)


# --- values that are right, or documented, where they cannot be checked ----------------


def _poisoned(x, lengths, value):
    """x `[B, L, ...]` with value at every position at or past each example's length."""
    hidden = jnp.arange(x.shape[1], dtype=jnp.int32)[None, :] >= lengths[:, None]
    return jnp.where(hidden.reshape(hidden.shape + (1,) * (x.ndim - 2)), value, x)


@pytest.mark.parametrize("implementation", ["dense", "chunked"])
@pytest.mark.parametrize("value", [jnp.nan, jnp.inf])
@pytest.mark.parametrize("how", ["key_lengths", "mask", "query_lengths", "segments"])
def test_nan_or_inf_in_hidden_positions_reaches_no_valid_output_or_gradient(
        implementation, value, how):
    """Padded or masked keys/values (or padded query rows) hold NaN/inf: the valid
    outputs and every gradient equal those of clean inputs (select, not multiply)."""
    kw, (q_bad, k_bad, v_bad) = {}, (q, k, v)
    if how == "query_lengths":
        kw["query_lengths"] = jnp.array([T, 2], jnp.int32)
        q_bad = _poisoned(q, kw["query_lengths"], value)
    else:
        if how == "key_lengths":
            kw["key_lengths"] = jnp.asarray(LENGTHS)
        elif how == "mask":
            kw["mask"] = (np.arange(S) < LENGTHS[:, None])[:, None, None, :]
        else:  # a key segment no query carries
            kw["mask"] = masks.segments(np.ones((B, T), np.int32),
                                        np.where(np.arange(S) < LENGTHS[:, None], 1, 2))
        # inf in the keys, -inf in the values (or NaN in both)
        k_bad, v_bad = _poisoned(k, LENGTHS, value), _poisoned(v, LENGTHS, -value)
    attend = functools.partial(dpa, implementation=implementation, **kw)

    @jax.jit
    def output_and_grads(q, k, v):
        out, pullback = jax.vjp(attend, q, k, v)
        return out, pullback(jnp.sin(out))   # a cotangent that reads every valid row

    (clean_out, clean_grads), (dirty_out, dirty_grads) = (output_and_grads(q, k, v),
                                                          output_and_grads(q_bad, k_bad, v_bad))
    np.testing.assert_allclose(dirty_out, clean_out, rtol=1e-6, atol=1e-7)
    for dirty_grad, clean_grad in zip(dirty_grads, clean_grads):
        assert np.all(np.isfinite(dirty_grad))
        np.testing.assert_allclose(dirty_grad, clean_grad, rtol=1e-5, atol=1e-7)


def test_minus_inf_bias_is_a_mask():
    bias = _zeros(B, 1, 1, S).at[1, :, :, 3:].set(-jnp.inf)
    np.testing.assert_allclose(dpa(q, k, v, bias=bias), dpa(q, k, v, key_lengths=LENGTHS),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype, huge", [(jnp.uint32, 2**32 - 1), (jnp.int64, 2**40),
                                         (jnp.uint64, 2**64 - 1)])
def test_traced_lengths_of_any_integer_dtype_are_exact(dtype, huge):
    """Under jit the values cannot be checked: a length past the sequence, however wide
    its dtype, means the whole sequence (it saturates, never wraps)."""
    attend = jax.jit(lambda lengths: dpa(q, k, v, key_lengths=lengths))
    expected = dpa(q, k, v, key_lengths=LENGTHS)
    np.testing.assert_allclose(attend(jnp.array([huge, 3], dtype)), expected, atol=1e-6)
    np.testing.assert_allclose(attend(jnp.array([S, 3], dtype)), expected, atol=1e-6)


def test_an_empty_value_dim_gives_an_empty_output():
    out = dpa(q, k, v[..., :0])
    assert out.shape == (B, T, N, 0)


def test_token_ids_outside_the_vocabulary_under_jit_embed_as_zeros_never_nan():
    """Under jit ids cannot be checked: any id outside [0, V) embeds as zeros (the
    logits are finite and the same for every such id)."""
    model, params = _decoder("sinusoidal")
    apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens))
    logits = [apply(jnp.array([[3, bad, 5]], jnp.int32)) for bad in (-1, 13, 10**6)]
    for x in logits:
        assert np.all(np.isfinite(x))
        np.testing.assert_array_equal(x, logits[0])
    assert not np.allclose(logits[0], apply(jnp.array([[3, 12, 5]], jnp.int32)))


@pytest.mark.parametrize("make_index", [int, np.uint32, np.int8, np.int64, jnp.asarray],
                         ids=["int", "uint32", "int8", "int64", "jax_array"])
def test_a_cache_index_of_any_integer_type_writes_its_slot(make_index):
    """lax's update takes one index type: an index other than int32 (a Python int or a
    NumPy/jax int64 under x64, a uint32, an int8) had failed with lax's TypeError."""
    cached = draws.normals(3, (2, 6, 1, 3), (2, 6, 1, 5))
    new = draws.normals(4, (2, 2, 1, 3), (2, 2, 1, 5))
    for append in (kv_cache.append, jax.jit(kv_cache.append)):
        out = append(*cached, make_index(3), *new)
        assert int(out.index) == 5 and out.index.dtype == jnp.int32
        for got, was, put in zip((out.key, out.value), cached, new):
            np.testing.assert_array_equal(got[:, 3:5], put)
            np.testing.assert_array_equal(got[:, :3], was[:, :3])
            np.testing.assert_array_equal(got[:, 5:], was[:, 5:])


def test_a_negative_traced_cache_index_is_logged_and_writes_from_slot_0(caplog):
    """(lax wrapped it: index -1 wrote the token into the last slot, silently, and the
    filled length came back 0)"""
    cached = draws.normals(5, (1, 4, 1, 2), (1, 4, 1, 2))
    new = draws.normals(6, (1, 1, 1, 2), (1, 1, 1, 2))
    with caplog.at_level("ERROR", logger="attnjax"):
        out = jax.jit(kv_cache.append)(*cached, -1, *new)
        jax.block_until_ready(out)
        jax.effects_barrier()
    assert "the cache index must be >= 0 (the first free slot); got -1" in caplog.text
    np.testing.assert_array_equal(out.key[:, :1], new[0])
    np.testing.assert_array_equal(out.key[:, 1:], cached[0][:, 1:])
    assert int(out.index) == 1


def test_multi_head_attention_takes_lists():
    """Inputs and parameters as nested lists, as the other functions take them (an
    AttributeError before)."""
    params = _mha_params()
    x = np.asarray(q[..., 0, :])
    listed = {name: {leaf: np.asarray(a).tolist() for leaf, a in p.items()}
              for name, p in params.items()}
    arrays = {name: {leaf: jnp.asarray(a) for leaf, a in p.items()}
              for name, p in listed.items()}
    np.testing.assert_array_equal(attnjax.multi_head_attention(listed, x.tolist()),
                                  attnjax.multi_head_attention(arrays, jnp.asarray(x.tolist())))


def test_what_the_checks_still_take():
    """Uses that ran before the checks of users' mistakes were added, and still run
    with the same results (a review found each refused by a first version of them)."""
    # masked_softmax: flax's 0/1 float masks, logits of any batch axes
    logits = draws.normals(20, (B, N, T, S))[0]
    keep = draws.randint(21, (B, 1, T, S), 0, 2) > 0
    np.testing.assert_array_equal(attnjax.masked_softmax(logits, keep.astype(jnp.float32)),
                                  attnjax.masked_softmax(logits, keep))
    # the models: tokens [L] (a batch of one), scalar positions of a decoding step, one
    # src_length for every example, lengths past S (all of it, as key lengths)
    model, params = _decoder("sinusoidal")
    tokens = draws.randint(22, (4,), 0, 13)
    with jax.numpy_rank_promotion("allow"):   # (jax's default: [L] meets [1, L])
        np.testing.assert_allclose(model.apply({"params": params}, tokens),
                                   model.apply({"params": params}, tokens[None]),
                                   rtol=1e-6)
    model, params = _transformer()
    src = draws.randint(23, (2, 3), 0, 7)
    apply = functools.partial(model.apply, {"params": params}, src, src % 9)
    np.testing.assert_allclose(apply(jnp.int32(2)), apply(jnp.array([2, 2])), rtol=1e-6)
    np.testing.assert_allclose(apply(jnp.array([9, 1])), apply(jnp.array([3, 1])), rtol=1e-6)
    # T5's odd bucket counts and 0/1 for bidirectional
    table = draws.normals(24, (5, N))[0]
    for bidirectional in (1, 0):
        assert dpa(q, k, v, score_mod=scores.relative_position_bias(
            table, num_buckets=5, max_distance=8, bidirectional=bidirectional)).shape == (
                B, T, N, V)
    # init_cache's input_shape as flax reads it (its last axis unread): NumPy and jax ints
    layer = attnjax.nnx.MultiHeadAttention(2, H, decode=True, rngs=flax.nnx.Rngs(0))
    for shape in ((B, T, 3), np.array([B, T, H]), (jnp.int32(B), T, H)):
        layer.init_cache(shape)
        assert layer.cached_key.shape == (B, T, 2, 2)
    # padding_mask's max_length as a jax or NumPy integer; query_key_mask's shared lengths
    lengths = jnp.array([3, 1])
    np.testing.assert_array_equal(masks.padding_mask(lengths, jnp.int32(4)),
                                  masks.padding_mask(lengths, 4))
    np.testing.assert_array_equal(masks.query_key_mask(lengths, jnp.array([2]), 4, 3),
                                  masks.query_key_mask(lengths, jnp.array([2, 2]), 4, 3))
    # a switch given None (off), as flax's decode=None; the functional layer's inputs_v
    # alone (keys from the queries, as its docstring says); core attention of no queries
    x = q[:, :, 0]
    layer = nn.MultiHeadDotProductAttention(num_heads=2, decode=None)
    variables = layer.init(jax.random.key(0), x)
    np.testing.assert_array_equal(layer.apply(variables, x),
                                  layer.clone(decode=False).apply(variables, x))
    np.testing.assert_allclose(
        attnjax.multi_head_attention(_mha_params(), x, inputs_v=2 * x),
        attnjax.multi_head_attention(_mha_params(), x, inputs_k=x, inputs_v=2 * x), rtol=1e-6)
    assert attnjax.attention(q[0, :0, 0], k[0, :, 0], v[0, :, 0]).shape == (0, V)
