import sys

from jaxinfer_tools.eval.run import main

sys.exit(main())
