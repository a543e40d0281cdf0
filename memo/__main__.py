import sys

from memo.cli.main import main

sys.exit(main())
