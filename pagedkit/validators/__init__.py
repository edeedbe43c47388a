"""Operator contracts as data, validation, shape inference and node builders."""

from .checks import check_inputs, require_valid_inputs, validate_node
from .contract import CONTRACTS, GROUP_QUERY_ATTENTION, PAGED_ATTENTION, OpContract, get_contract
from .issues import Issue, ValidationError

__all__ = [
    "CONTRACTS", "GROUP_QUERY_ATTENTION", "PAGED_ATTENTION", "Issue", "OpContract", "ValidationError",
    "check_inputs", "get_contract", "require_valid_inputs", "validate_node",
]
