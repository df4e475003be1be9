from llm_anatomy.distributed.strategies import exit_rank
from llm_anatomy.entry import guarded
from llm_anatomy.train.cli import main

exit_rank(guarded("anatomy train", main))
