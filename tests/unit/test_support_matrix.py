"""The support matrix (docs/configuration.md) is built from test outcomes only."""

from __future__ import annotations

from tests.support_matrix import build_table


def _row(table: str, family: str) -> list[str]:
    [line] = [r for r in table.splitlines() if r.startswith(f"| {family} |")]
    return [c.strip() for c in line.strip("|").split("|")]


def test_cells_follow_the_outcomes() -> None:
    results = {
        "test_family_equals_generate[mistral]": "passed",
        "test_dynamic_batching_equals_generate[mistral]": "passed",
        "test_tensor_parallel_equals_generate[mistral]": "failed",
        "test_families_through_http_equal_generate[llama+mistral+qwen2]": "passed",
        "test_family_refused_by_name[bloom]": "passed",
        "test_refused_families_fail_with_the_reason": "passed",
        "test_tensor_parallel_refused_before_ranks_start[phi3]": "passed",
        "test_family_equals_generate[phi3]": "failed",
        "test_bf16_against_generate_bf16[mistral]": "passed",
        "test_bf16_against_generate_bf16[mistral]#bf16_first_divergence": "20",
        "test_bf16_against_generate_bf16[bloom]": "failed",
    }
    table = build_table(results)
    assert _row(table, "mistral") == ["mistral", "mistral", "exact", "exact", "exact", "FAILED", "exact", "exact",
                                      "close"]
    assert _row(table, "bloom") == ["bloom", "bloom", "refused", "refused", "-", "-", "-", "-", "FAILED"]
    assert _row(table, "phi3") == ["phi3", "phi3", "FAILED", "-", "-", "refused", "-", "-", "-"]
    assert _row(table, "gpt2") == ["gpt2", "gpt2", "-", "-", "-", "-", "-", "-", "-"]
