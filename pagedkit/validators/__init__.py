"""Operator contracts as data, validation, shape inference and node builders."""

from .builders import make_gqa_node, make_paged_attention_node
from .checks import check_inputs, require_valid_inputs, validate_node
from .contract import CONTRACTS, GROUP_QUERY_ATTENTION, PAGED_ATTENTION, OpContract, get_contract
from .inference import infer_node_outputs, register_schemas
from .issues import Issue, ValidationError
from .model import validate_model

__all__ = [
    "CONTRACTS", "GROUP_QUERY_ATTENTION", "PAGED_ATTENTION", "Issue", "OpContract", "ValidationError",
    "check_inputs", "get_contract", "infer_node_outputs", "make_gqa_node", "make_paged_attention_node",
    "register_schemas", "require_valid_inputs", "validate_model", "validate_node",
]
