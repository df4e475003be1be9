"""The validation suite. It reads the records of the checkout it lives in (llm_anatomy.records)."""
from pathlib import Path

from llm_anatomy import records

records.use(Path(__file__).resolve().parent.parent)
