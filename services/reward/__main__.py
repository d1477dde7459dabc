"""`python -m reinforce.reward`: the reward server."""

import sys

from reinforce.reward.main import main

sys.exit(main())
