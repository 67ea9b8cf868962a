import sys

from jaxinfer.tools.bench.run import main

sys.exit(main())
