"""Patch: ``vllm.v1.worker.gpu.spec_decode.init_speculator`` (and its name in
``vllm.v1.worker.gpu.model_runner``, which imports it) and
``vllm.config.vllm.VllmConfig._get_v2_model_runner_unsupported_features``.

Why: vLLM's V2 model runner builds its speculator in this one function, from a closed list
of vLLM's own methods; a ``custom_class`` config (how diffspec's methods reach vLLM) gets
``NotImplementedError``, and there is no registry for V2 speculators. Before that, vLLM's
config validation refuses ``custom_class`` on the V2 runner ("Model Runner V2 does not yet
support: speculative method 'custom_class'") and, with ``VLLM_USE_V2_MODEL_RUNNER`` unset,
picks the V1 runner for it.

How: wrap it: for a diffspec self-speculative config
(:func:`diffspec.plugin.vllm.config.is_self_spec_proposer`), build diffspec's V2 speculator
(:class:`diffspec.spec_workers.vllm.two_pass_v2.TwoPassSpeculator` for ``orthrus`` /
``linear_self_spec``, a ``DraftModelSpeculator`` whose draft model is the served model's
diffusion view; :class:`diffspec.spec_workers.vllm.tidar_v2.TiDARSpeculator` for ``tidar``,
which plans the step's branches in the model state's ``prepare_attn`` and runs them in the
target forward: it wraps both on their instances); every other config gets vLLM's own
speculator. The runner then drives it as any V2 speculator: ``load_model`` with the target
model, ``set_attn`` with its model state, block tables and attention groups, ``propose``
after each verify, and its own sampler / rejection sampler / scheduler do the rest. The
list of features the V2 runner lacks drops diffspec's ``custom_class`` config only when the
user asked for the V2 runner (``VLLM_USE_V2_MODEL_RUNNER=1``, the setting the config patch
``speculative_method`` checks the launch against); left unset, vLLM still picks the V1
runner for diffspec's methods.
"""

from __future__ import annotations

import functools

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

_SPECULATOR = "vllm.v1.worker.gpu.spec_decode.speculator"
_PROPOSE = ("self", "input_batch", "attn_metadata", "slot_mappings", "last_hidden_states",
            "aux_hidden_states", "num_sampled", "num_rejected", "last_sampled",
            "next_prefill_tokens", "temperature", "seeds", "dp_sync_state", "dummy_run",
            "skip_attn_for_dummy_run", "mm_inputs", "is_profile", "num_speculative_tokens")
TARGETS = (
    Target("vllm.v1.worker.gpu.spec_decode", "init_speculator",
           ("vllm_config", "device", "req_states"),
           relies_on=(
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.__init__",
                "self.speculator = init_speculator( self.vllm_config, self.device, "
                "self.req_states )"),
               # the runner hands a DraftModelSpeculator the target model and its cache
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.load_model",
                "if isinstance(self.speculator, DraftModelSpeculator): ... "
                "self.speculator.load_model(self.model)"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.initialize_kv_cache",
                "self.speculator.set_attn( self.model_state, self.kv_cache_config, "
                "self.block_tables, self.input_buffers, self.attn_groups, )"),
               # after the verify's bookkeeping: num_computed_tokens is the anchor's position
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
                "self.postprocess_sampled( ... draft_tokens = self.speculator.propose( ... "
                "self.req_states.draft_tokens[input_batch.idx_mapping] = draft_tokens"),
               ("vllm.v1.worker.gpu.input_batch:_post_update_kernel",
                "tl.store(last_sampled_tokens_ptr + req_state_idx, token_id) ... "
                "tl.store(num_computed_tokens_ptr + req_state_idx, num_computed + "
                "computed_delta)"),
               ("vllm.v1.worker.gpu.block_table:BlockTables.append_block_ids",
                "self.num_blocks.np[i, req_index] = end"),
               # tidar: the model state's metadata, then the target forward called eagerly
               # on the model instance (cudagraph_mode NONE), the scheduled tokens'
               # hidden states to the sampler, all of them to propose()
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.execute_model",
                "attn_metadata = self.model_state.prepare_attn( input_batch, "
                "batch_desc.cg_mode, block_tables, slot_mappings, attn_groups, "
                "self.kv_cache_config, ... for_capture= ... else: ... "
                "model_output = self.model(**model_inputs)"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample_tokens",
                "sampler_output, num_sampled, num_rejected = self.sample( hidden_states, "
                "input_batch, grammar_output ) ... self.postprocess_sampled( ... "
                "spec_hidden_states = get_drafter_hidden_states( ... num_sampled,"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.sample",
                "sample_hidden_states = hidden_states[input_batch.logits_indices]"),
               # a dummy batch's requests are none of the request states'
               ("vllm.v1.worker.gpu.input_batch:InputBatch.make_dummy",
                "req_ids = [f\"req_{i}_{random_uuid()}\" for i in range(num_reqs)]"),
               ("vllm.v1.worker.gpu.model_runner:GPUModelRunner.update_requests",
                "num_computed_tokens_np[req_index] = num_computed_tokens"),
           )),
    # the model state method TiDARSpeculator wraps (the runner's call passes no ubatch_idx)
    Target("vllm.v1.worker.gpu.model_states.default", "DefaultModelState.prepare_attn",
           ("self", "input_batch", "cudagraph_mode", "block_tables", "slot_mappings",
            "attn_groups", "kv_cache_config", "for_capture", "ubatch_idx",
            "model_specific_attn_metadata")),
    # the base-class methods TwoPassSpeculator overrides: same names and parameters, or
    # the runner would call vLLM's versions
    Target(_SPECULATOR, "DraftModelSpeculator.__init__", ("self", "vllm_config", "device")),
    Target(_SPECULATOR, "DraftModelSpeculator.load_model", ("self", "target_model")),
    Target(_SPECULATOR, "DraftModelSpeculator.load_draft_model",
           ("self", "target_model", "target_attn_layer_names")),
    Target(_SPECULATOR, "DraftModelSpeculator.set_attn",
           ("self", "model_state", "kv_cache_config", "block_tables", "target_input_buffers",
            "target_attn_groups")),
    Target(_SPECULATOR, "BaseSpeculator.init_cudagraph_manager", ("self", "cudagraph_mode")),
    Target(_SPECULATOR, "BaseSpeculator.capture", ("self",)),
    Target(_SPECULATOR, "BaseSpeculator.propose", _PROPOSE),
)

CUSTOM_CLASS_ENTRY = "speculative method 'custom_class'"
TARGETS += (
    Target("vllm.config.vllm", "VllmConfig._get_v2_model_runner_unsupported_features",
           ("self",),
           relies_on=(
               ("vllm.config.vllm:VllmConfig._get_v2_model_runner_unsupported_features",
                "unsupported.append(f\"speculative method '{speculative_config.method}'\")"),
               ("vllm.config.vllm:VllmConfig._validate_v2_model_runner",
                "unsupported = self._get_v2_model_runner_unsupported_features()"),
               ("vllm.config.vllm:VllmConfig.use_v2_model_runner",
                "use_v2_model_runner = envs.VLLM_USE_V2_MODEL_RUNNER ... "
                "return use_v2_model_runner ... "
                "unsupported = self._get_v2_model_runner_unsupported_features()"),
           )),
    # tidar: the kernel block split, computed at config time as the runner computes it
    Target("vllm.v1.worker.utils", "select_common_block_size",
           ("kv_manager_block_size", "backends", "kv_cache_specs"),
           relies_on=(("vllm.v1.worker.utils:AttentionGroup.create_metadata_builders",
                       "kernel_block_size = select_common_block_size( kernel_block_size, "
                       "[self.backend], [spec] )"),)),
    Target("vllm.v1.attention.backend", "AttentionBackend.get_preferred_block_size",
           ("cls", "default_block_size"),
           relies_on=(("vllm.platforms.interface:Platform.update_block_size_for_backend",
                       "if not cache_config.user_specified_block_size: preferred = "
                       "cls._preferred_block_size_for_backends("),
                      ("vllm.platforms.interface:Platform._preferred_block_size_for_backends",
                       "if len(backend_classes) == 1: return backend_classes[0]."
                       "get_preferred_block_size(default_block_size)"))),
)

def apply() -> None:
    import sys

    import vllm.v1.worker.gpu.spec_decode as spec_decode

    original = spec_decode.init_speculator
    if is_applied(original):
        return

    @functools.wraps(original)
    def init_speculator(vllm_config, device, req_states):
        from diffspec.plugin.vllm.config import is_self_spec_proposer

        spec = vllm_config.speculative_config
        if not is_self_spec_proposer(spec):
            return original(vllm_config, device, req_states)
        method = _method(vllm_config)
        if method == "tidar":
            from diffspec.spec_workers.vllm.tidar_v2 import TiDARSpeculator

            return TiDARSpeculator(vllm_config, device, req_states)
        from diffspec.spec_workers.vllm.two_pass_v2 import TwoPassSpeculator

        return TwoPassSpeculator(vllm_config, device, req_states, method)

    wrapped = mark(init_speculator, __name__)
    spec_decode.init_speculator = wrapped
    # the runner's module binds the name at import: rebind it there too if it is loaded
    # (else it imports the wrapped one)
    runner_module = sys.modules.get("vllm.v1.worker.gpu.model_runner")
    if runner_module is not None:
        runner_module.init_speculator = wrapped
    _allow_on_v2_runner()


def _allow_on_v2_runner() -> None:
    from vllm import envs
    from vllm.config.vllm import VllmConfig

    from diffspec.plugin.vllm.config import is_self_spec_proposer

    original = VllmConfig._get_v2_model_runner_unsupported_features
    if is_applied(original):
        return

    @functools.wraps(original)
    def unsupported_features(self) -> list[str]:
        features = original(self)
        if envs.VLLM_USE_V2_MODEL_RUNNER is True and is_self_spec_proposer(
                self.speculative_config):
            features = [f for f in features if f != CUSTOM_CLASS_ENTRY]
            if _method(self) == "tidar":  # config validation: before the weights load
                from diffspec.plugin.vllm.config import tidar_kernel_split_error

                error = tidar_kernel_split_error(self)
                if error:
                    raise ValueError(error)
        return features

    VllmConfig._get_v2_model_runner_unsupported_features = mark(unsupported_features,
                                                                 __name__)


def _method(vllm_config) -> str:
    """The diffspec method of a translated config: the one whose proposer it names and
    that serves the model's architecture (Orthrus and NLD linear share a proposer)."""
    from diffspec.plugin.vllm.config import proposer_path, self_spec_methods

    arch = (getattr(vllm_config.model_config.hf_config, "architectures", None) or [""])[0]
    names = [name for name in self_spec_methods()
             if proposer_path(name) == vllm_config.speculative_config.model]
    return next((n for n in names if arch in self_spec_methods()[n].architectures), names[0])
