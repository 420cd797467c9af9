"""Split rules, one module per op family; importing this package registers them.

RULES maps an op type to `rule(ctx) -> Decision` (see rules/base.py).
"""
from tfsplit.rules import elementwise  # pylint: disable=unused-import
from tfsplit.rules import matmul  # pylint: disable=unused-import
from tfsplit.rules import nn  # pylint: disable=unused-import
from tfsplit.rules import reduce  # pylint: disable=unused-import
from tfsplit.rules import shape  # pylint: disable=unused-import
from tfsplit.rules import variables  # pylint: disable=unused-import
from tfsplit.rules.base import RULES, Decision, OpContext, register  # pylint: disable=unused-import
