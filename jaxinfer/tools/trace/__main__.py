import sys

from jaxinfer.tools.trace.run import main

sys.exit(main())
