import sys

from anatomy.train.cli import main

sys.exit(main())
