import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

# The suite runs tiny models: thread start-up costs more than it saves, and on a busy 2-core machine extra threads
# turn microsecond ops into 100 ms stalls.
torch.set_num_threads(1)
