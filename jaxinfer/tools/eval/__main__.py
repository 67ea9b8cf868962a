import sys

from jaxinfer.tools.eval.run import main

sys.exit(main())
