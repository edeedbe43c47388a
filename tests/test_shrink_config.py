"""`--num-experts` on group-limited routing (DeepSeek V3: 256 experts in 8 groups, top-4 groups, top-8 experts):
shrinking to 8 experts keeps >= 2 experts per group (V3 ranks a group by its top-2 scores; 8 groups of 1 made
the graph's group TopK fail at run time), topk_group shrinks in proportion, and top-k stays within the kept
groups' experts. Ungrouped models (V2: n_group 1) are unchanged but for the expert count."""

from transformers import DeepseekV2Config, DeepseekV3Config

from pagedkit.exporters.weights import shrink_config


def test_v3_groups_shrink_with_the_experts():
    c = shrink_config(DeepseekV3Config(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8), 4, 8)
    assert (c.n_routed_experts, c.n_group, c.topk_group, c.num_experts_per_tok) == (8, 4, 2, 4)
    c = shrink_config(DeepseekV3Config(n_routed_experts=256, n_group=8, topk_group=4, num_experts_per_tok=8), 4, 64)
    assert (c.n_routed_experts, c.n_group, c.topk_group, c.num_experts_per_tok) == (64, 8, 4, 8)


def test_ungrouped_routing_is_unchanged():
    c = shrink_config(DeepseekV2Config(n_routed_experts=64, n_group=1, topk_group=1, num_experts_per_tok=6), 2, 8)
    assert (c.n_routed_experts, c.n_group, c.topk_group, c.num_experts_per_tok) == (8, 1, 1, 6)
