import sys

from jaxinfer_tools.trace.run import main

sys.exit(main())
