"""Every megatron-core ``TransformerConfig`` field, and what memo does with it.

NOTE [megatron-core's config fields under memo]
memo's megatron path computes a ``TransformerLayer`` from its submodules (NOTE [Megatron layer
anatomy] in memo/adapters/megatron.py), and memo's spec replaces ``DotProductAttention`` by
:class:`memo.adapters.megatron.MemoCoreAttention`. A config field that changes what those compute
is either run by memo or refused when it is not at its default (NOTE [memo runs the layer the user
wrote, or refuses it] in memo/adapters/exact.py). Every field of the config is in one of the sets
below, and tests/adapters/test_megatron.py fails on a field no set names
(test_every_transformer_config_field_is_run_or_refused), so a megatron-core release that adds one
is looked at before it is trained:

- :data:`RUN`: memo's path computes what megatron computes for any value (the field is read by a
  submodule memo calls, by megatron's rotary function memo calls, or by memo's own core attention;
  ``attention_dropout``: MemoCoreAttention refuses any but 0 itself);
- :data:`CORE_DEFAULT`: the arithmetic of megatron's core attention, which ``MemoCoreAttention``
  does not implement: refused by it unless at the default (megatron's own core attention, run by
  memo as a black box, honours them);
- :data:`LAYER_DEFAULT`: the glue of ``SelfAttention.forward`` / ``TransformerLayer.forward`` that
  memo's adapter reproduces without it: refused by the adapter unless at the default, whatever the
  core attention;
- :data:`NOT_ATTENTION`: parallel sizes (checked where the layout is made), initialisation,
  precision recipes, fusions that compute the same, pipeline, MoE and Mamba settings (MoE and
  hybrid layers are refused by the layer check), inference switches, and the settings of a feature
  whose own switch is refused above (``recompute_method`` of ``recompute_granularity``, ``qk_clip_alpha``
  of ``qk_clip``, ...).
"""

from __future__ import annotations

import dataclasses

__all__ = ["CORE_DEFAULT", "LAYER_DEFAULT", "NOT_ATTENTION", "RUN", "changed_fields"]

RUN = frozenset({
    "activation_func", "activation_func_clamp_value", "activation_func_fp8_input_store",
    "add_bias_linear", "add_qkv_bias", "apply_rope_fusion", "attention_backend", "attention_dropout",
    "attention_softmax_in_fp32", "batch_invariant_mode", "bf16", "bias_activation_fusion",
    "bias_dropout_fusion", "context_parallel_size", "cp_comm_type", "deterministic_mode",
    "ffn_hidden_size", "fp16", "fused_single_qkv_rope", "gated_linear_unit", "glu_linear_offset",
    "hidden_dropout", "hidden_size", "kv_channels", "layernorm_epsilon", "layernorm_zero_centered_gamma",
    "masked_softmax_fusion", "memory_efficient_layer_norm", "no_rope_freq", "normalization",
    "num_attention_heads", "num_query_groups", "params_dtype", "persist_layer_norm", "qk_l2_norm",
    "qk_layernorm", "rotary_interleaved", "sequence_parallel", "tensor_model_parallel_size",
    "use_fused_weighted_squared_relu", "use_te_activation_func",
})

CORE_DEFAULT = frozenset({
    "apply_query_key_layer_scaling", "fp8_dot_product_attention", "log_max_attention_logit", "qk_clip",
    "softmax_scale", "softmax_type", "use_kitchen_attention", "window_attn_skip_freq", "window_size",
})

LAYER_DEFAULT = frozenset({
    "apply_residual_connection_post_layernorm", "attention_output_gate", "cpu_offloading",
    "cuda_graph_impl", "delay_wgrad_compute", "enable_cuda_graph", "experimental_attention_variant",
    "external_cuda_graph", "fine_grained_activation_offloading", "fp32_residual_connection",
    "fp8_multi_head_attention", "heterogeneous_block_specs", "hierarchical_context_parallel_sizes",
    "hybrid_context_parallel", "is_hybrid_model", "linear_attention_freq", "mrope_section",
    "multi_latent_attention", "recompute_granularity",
})

NOT_ATTENTION = frozenset({
    "_cpu_offloading_context", "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split", "async_tensor_model_parallel_allreduce", "autocast_dtype",
    "barrier_with_L1_time", "batch_p2p_comm", "batch_p2p_sync", "calculate_per_token_loss",
    "clone_scatter_output_in_embedding", "config_logger_dir", "cpu_offloading_activations",
    "cpu_offloading_double_buffering", "cpu_offloading_num_layers", "cpu_offloading_weights",
    "cross_entropy_fusion_impl", "cross_entropy_loss_fusion", "cuda_graph_retain_backward_graph",
    "cuda_graph_scope", "cuda_graph_use_single_mempool", "cuda_graph_warmup_steps",
    "deallocate_pipeline_outputs", "defer_embedding_wgrad_compute",
    "disable_bf16_reduced_precision_matmul", "disable_parameter_transpose_cache",
    "distribute_saved_activations", "dsa_indexer_head_dim", "dsa_indexer_loss_coeff",
    "dsa_indexer_n_heads", "dsa_indexer_topk", "dsa_indexer_use_sparse_loss", "embedding_init_method",
    "embedding_init_method_std", "enable_autocast", "ep_overlap_early_attn_memory_release",
    "expert_model_parallel_size", "expert_tensor_parallel_size", "finalize_model_grads_func",
    "first_last_layers_bf16", "flash_decode", "fp4", "fp4_param", "fp4_quantizer_factory", "fp4_recipe",
    "fp8", "fp8_amax_compute_algo", "fp8_amax_history_len", "fp8_interval", "fp8_margin", "fp8_param",
    "fp8_quantizer_factory", "fp8_recipe", "fp8_wgrad", "grad_scale_func", "grad_sync_func",
    "gradient_accumulation_fusion", "hetereogenous_dist_checkpoint", "inference_fuse_tp_communication",
    "inference_rng_tracker", "inference_sampling_seed", "init_method", "init_method_std",
    "init_model_with_meta_device", "kitchen_attention_backend", "linear_conv_kernel_dim",
    "linear_key_head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_value_head_dim",
    "mamba_head_dim", "mamba_num_groups", "mamba_num_heads", "mamba_state_dim",
    "max_seqlen_per_dp_cp_rank", "microbatch_group_size_per_vp_stage", "min_offloaded_tensor_size",
    "mlp_chunks_for_prefill", "moe_apply_probs_on_input", "moe_aux_loss_coeff", "moe_deepep_num_sms",
    "moe_enable_deepep", "moe_enable_routing_replay", "moe_expert_capacity_factor", "moe_extended_tp",
    "moe_ffn_hidden_size", "moe_flex_dispatcher_backend", "moe_grouped_gemm", "moe_hybridep_num_sms",
    "moe_input_jitter_eps", "moe_latent_size", "moe_layer_freq", "moe_layer_recompute",
    "moe_pad_expert_input_to_capacity", "moe_per_layer_logging", "moe_permute_fusion",
    "moe_router_bias_update_rate", "moe_router_dtype", "moe_router_enable_expert_bias",
    "moe_router_force_load_balancing", "moe_router_fusion", "moe_router_group_topk",
    "moe_router_load_balancing_type", "moe_router_num_groups", "moe_router_padding_for_fp8",
    "moe_router_padding_for_quantization", "moe_router_pre_softmax", "moe_router_score_function",
    "moe_router_topk", "moe_router_topk_limited_devices", "moe_router_topk_scaling_factor",
    "moe_shared_expert_gate", "moe_shared_expert_intermediate_size", "moe_shared_expert_overlap",
    "moe_token_dispatcher_type", "moe_token_drop_policy", "moe_token_dropping",
    "moe_use_legacy_grouped_gemm", "moe_z_loss_coeff", "mtp_loss_scaling_factor", "mtp_num_layers",
    "mtp_standalone", "no_sync_func", "num_layers", "num_layers_at_end_in_bf16",
    "num_layers_at_start_in_bf16", "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage", "num_microbatches_with_partial_activation_checkpoints",
    "num_moe_experts", "offload_modules", "output_layer_init_method", "overlap_moe_expert_parallel_comm",
    "overlap_p2p_comm", "overlap_p2p_comm_warmup_flush", "param_sync_func", "perform_initialization",
    "pipeline_dtype", "pipeline_model_parallel_comm_backend", "pipeline_model_parallel_layout",
    "pipeline_model_parallel_size", "qk_clip_alpha", "qk_clip_threshold", "quant_recipe",
    "recompute_method", "recompute_modules", "recompute_num_layers", "symmetric_ar_type", "test_mode",
    "timers", "tp_comm_atomic_ag", "tp_comm_atomic_rs", "tp_comm_bootstrap_backend", "tp_comm_bulk_dgrad",
    "tp_comm_bulk_wgrad", "tp_comm_overlap", "tp_comm_overlap_ag", "tp_comm_overlap_disable_fc1",
    "tp_comm_overlap_disable_qkv", "tp_comm_overlap_rs", "tp_comm_overlap_rs_dgrad", "tp_comm_split_ag",
    "tp_comm_split_rs", "tp_only_amax_red", "transformer_impl", "use_cpu_initialization",
    "use_inference_optimized_layers", "use_kitchen", "use_mamba_mem_eff_path", "use_ring_exchange_p2p",
    "use_te_rng_tracker", "variable_seq_lengths", "virtual_pipeline_model_parallel_size",
    "wgrad_deferral_limit",
})


def _default(field: dataclasses.Field[object]) -> object:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def changed_fields(config: object, names: frozenset[str]) -> list[str]:
    """``name=value`` of each field in ``names`` whose value in ``config`` is not megatron-core's
    ``TransformerConfig`` default (``config`` may be any object with some of its attributes)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    out = []
    for field in dataclasses.fields(TransformerConfig):
        if field.name not in names:
            continue
        default = _default(field)
        value = getattr(config, field.name, default)
        if default is dataclasses.MISSING or value is None and default is None:
            continue
        try:
            same = bool(value == default)
        except (TypeError, RuntimeError, ValueError):
            same = value is default
        if not same:
            out.append(f"{field.name}={value!r}")
    return out
