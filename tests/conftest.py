"""Test configuration.

Without a GPU the Triton kernels run in the interpreter: TRITON_INTERPRET must be set before any
``@triton.jit`` is decorated, i.e. before cce's kernel modules are imported, hence here.
"""

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per pytest-xdist worker (and per process it spawns, through the
    # environment): as many workers as cores, each with a thread per core, would leave OpenMP's
    # spinning threads waiting on each other.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The tiers (README, "Commands"): `make test` runs the default one, `make test-all` sets
# CCE_TEST_TIER=all. The default tier's properties are derandomized (the same examples every
# run, so a red run reproduces) with the counts of tests/helpers.examples; the thorough tier
# draws fresh examples, as many as each property asks for.
settings.register_profile(
    "cce-default", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("cce-all", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("cce-all" if os.environ.get("CCE_TEST_TIER") == "all" else "cce-default")


# The heaviest CPU tests in the interpreter (seconds each on 2 cores): the tests below keep one
# case in the default tier (the case id given, or the first case when None; a tuple: those
# cases), which runs the same kernels as the others; their other cases, and the tests of
# THOROUGH_ONLY, run in the thorough tier (they are marked `slow`). Tests marked `slow` in their
# own files add to these.
ONE_CASE: dict[str, str | tuple[str, ...] | None] = {
    "test_dense_slabs.py::test_all_dense_is_exact": None,
    "test_dense_slabs.py::test_slab_errors_against_float64": None,
    "test_dense_slabs.py::test_flags_follow_the_rule": "0.1-2.0-1",
    "test_dense_slabs.py::test_slab_products_against_float64": "300-64-33",
    # fp16 (dC's sum over the row blocks in scaled fp16, smoothing) and dE alone (fp32)
    "test_dense_slabs.py::test_all_dense_by_row_blocks": ("dtype1-both-opts1", "dtype3-de-opts3"),
    "test_triton_sparse.py::test_sparse_entropy_term_within_stated_bound": "plain",
    "test_triton_sparse.py::test_stash_layout_gives_the_same_gradients": "dtype3-6-False",
    "test_triton_sparse.py::test_sparse_filter_sound_and_within_stated_bound": "softcap=3.0",
    "test_triton_sparse.py::test_minus_inf_bias_masking_whole_tiles": None,
    "test_triton_sparse.py::test_encoded_tile_statistics": None,
    "test_triton_linear.py::test_default_filter_close_to_exact": None,
    # fp32 "mean" / "sum" take the fused path, whose kernels test_triton_fused.py::test_fused_vs_oracle
    # runs with these options; the default tier keeps fp32 where the exact backward runs and fp16
    # (always the exact backward) for combinations that hold every option (bias and softcap,
    # smoothing and weight, lse with z-loss and "none", shift with every term)
    "test_triton_linear.py::test_options_vs_oracle": (
        "label_smoothing=0.2-softcap=3.0-dtype0",
        "return_lse=True-reduction=none-z_loss=0.001-dtype0",
        "reduction=none-dtype0",
        "shift=True-bias=True-label_smoothing=0.05-softcap=5.0-weight=True-dtype0",
        "plain-dtype1",
        "bias=True-softcap=4.0-dtype1",
        "label_smoothing=0.2-softcap=3.0-dtype1",
        "label_smoothing=0.1-weight=True-dtype1",
        "return_lse=True-reduction=none-z_loss=0.001-dtype1",
        "reduction=sum-dtype1",
        "shift=True-bias=True-label_smoothing=0.05-softcap=5.0-weight=True-dtype1",
        "ignore_index=3-dtype1",
    ),
    # (the sparse backward in fp32 runs in the other sparse tests)
    "test_triton_linear.py::test_sparse_backward_with_tiny_threshold": "dtype1",
    "test_first_order.py::test_sparse_backward_with_first_order_is_the_model": None,
    "test_first_order.py::test_gram_against_float64": None,
    "test_dc_estimate.py::test_dc_norm_estimate": None,
    "test_dc_estimate.py::test_class_sample_dz_against_float64": None,
    "test_de_norm_estimate.py::test_exact_when_every_row_is_sampled": None,
    "test_slab_rule.py::test_kernel_equals_torch_rule": None,
    "test_slab_rule.py::test_kernel_against_float64_vectors": None,
    "test_slab_rule.py::test_systematic_sample_against_float64": None,
    # (without the first-order vectors: the same chunk loop; their absence in test_kernel_equals_torch_rule)
    "test_slab_rule.py::test_gram_over_many_partials": "True",
    # the log-probabilities' coefficient in the exact and the sparse backward
    "test_token_outputs.py::test_triton_logprobs_are_minus_the_loss": (
        "None-tuning0",
        "0.000244140625-tuning1",
    ),
    "test_host_gating.py::test_same_gradients_bit_for_bit": "scattered-de",
    "test_host_gating.py::test_same_gradients_bit_for_bit_with_options": None,
    "test_triton_tma.py::test_tma_path_matches_plain_loads": None,
    "test_triton_tma.py::test_tma_exact_slabs_match_plain_kernel": None,
}
THOROUGH_ONLY = {
    # the dense-slab error rule's statistical tests (the rule's code runs in test_flags_follow_the_rule)
    "test_dense_slabs.py::test_error_rule_on_near_uniform_rows",
    "test_dense_slabs.py::test_error_rule_meets_its_target_when_every_row_is_sampled",
    # mixed dense and sparse slabs (the dense slabs' kernels run in test_all_dense_is_exact)
    "test_dense_slabs.py::test_mixed_slabs_exact_where_dense",
    # the size rule end to end (the rule itself: test_triton_fused.py::test_fused_dispatch)
    "test_triton_linear.py::test_exact_below_sparse_min_flops",
    # the outputs' gradients in the sparse backward (also test_triton_logprobs_are_minus_the_loss)
    "test_token_outputs.py::test_triton_outputs_keep_the_sparse_backward",
    # the statistical quality of the dense-slab, dC and first-order rules' estimates over many
    # seeds (the estimators' kernels run in the ONE_CASE tests above)
    "test_de_norm_estimate.py::test_half_the_rows_without_a_target_term",
    "test_first_order.py::test_rule_on_near_uniform_rows_meets_the_target_without_dense_slabs",
    "test_first_order.py::test_rule_off_where_rank1_meets_the_target",
    "test_dc_estimate.py::test_dc_rule_meets_its_target_when_every_row_is_sampled",
    "test_dc_estimate.py::test_dc_estimates_from_sampled_rows",
    # host gating's late first-order flag and the options' bit-for-bit cases (minutes each in the
    # interpreter; test_same_gradients_bit_for_bit keeps one case in the default tier), and what
    # the host leaves out where the device turned the slabs off
    "test_host_gating.py::test_first_order_flag_arriving_after_the_plan",
    "test_host_gating.py::test_same_gradients_bit_for_bit_with_options",
    "test_host_gating.py::test_gating_leaves_out_what_the_device_turned_off",
    # the dC estimators against exact sums (their kernels: test_dc_norm_estimate)
    "test_dc_estimate.py::test_dc_estimates_are_exact_when_every_row_is_sampled",
    # the sparse backward through the public API against the exact one on zipf data (through the
    # public API also in test_triton_linear.py::test_sparse_backward_with_tiny_threshold, and
    # against its bound in test_sparse_filter_sound_and_within_stated_bound)
    "test_triton_sparse.py::test_sparse_public_api_vs_exact",
    # scratch slots against recomputed tiles (both serve kept tiles in every sparse test)
    "test_triton_sparse.py::test_scratch_and_recompute_agree",
    # the sparse backward given the forward's orders against making them again (the public API
    # passes them: against the oracle in test_triton_linear.py::test_sparse_backward_with_tiny_threshold
    # and test_default_filter_close_to_exact; made again in the direct sparse_backward tests)
    "test_triton_sparse.py::test_backward_reads_the_forwards_orders",
    # the first-order terms left out where they cannot pay (that plan, run by the backward:
    # test_explain.py::test_explain_slab_plan_is_the_sparse_backwards, its case of 4 rows)
    "test_first_order.py::test_terms_left_out_where_they_cannot_pay",
}


def _case_id(item) -> str | None:
    return item.callspec.id if hasattr(item, "callspec") else None


def pytest_collection_modifyitems(config, items):
    slow = pytest.mark.slow
    kept: dict[str, str | None] = {}
    seen: dict[str, set[str | None]] = {}
    for item in items:
        key = f"{item.path.name}::{item.originalname}"
        if key in THOROUGH_ONLY:
            item.add_marker(slow)
        elif key in ONE_CASE:
            seen.setdefault(key, set()).add(_case_id(item))
            want = ONE_CASE[key] or kept.setdefault(key, _case_id(item))
            if _case_id(item) not in (want if isinstance(want, tuple) else (want,)):
                item.add_marker(slow)
    # A case id of ONE_CASE that no longer exists would move its test to the thorough tier
    # silently (checked where a test's cases were collected together, not one node picked).
    stale = {
        key: sorted(set(want if isinstance(want, tuple) else (want,)) - ids)
        for key, ids in seen.items()
        if len(ids) > 1 and (want := ONE_CASE[key]) is not None
    }
    stale = {key: ids for key, ids in stale.items() if ids}
    if stale:
        raise pytest.UsageError(f"tests/conftest.py ONE_CASE names cases that were not collected: {stale}")
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (make test-gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
