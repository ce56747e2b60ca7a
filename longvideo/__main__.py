import sys

from longvideo.cli import main

sys.exit(main())
