"""The hypothesis strategy of real-depth cases: llm_anatomy.real_depth's shapes, drawn by hypothesis."""
from __future__ import annotations

from hypothesis import assume
from hypothesis import strategies as st

from llm_anatomy.real_depth import H200_CAPACITY, Case, Rejected, case_from


@st.composite
def real_depth_cases(draw, capacity: int = H200_CAPACITY) -> Case:
    """The hypothesis strategy of real-depth cases (llm_anatomy.real_depth)."""
    try:
        return case_from(lambda xs: draw(st.sampled_from(xs)), lambda lo, hi: draw(st.integers(lo, hi)),
                         lambda: draw(st.booleans()), capacity)
    except Rejected:
        assume(False)
