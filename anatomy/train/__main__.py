from anatomy.distributed.strategies import exit_rank
from anatomy.train.cli import main

exit_rank(main())
