"""Print the GPU machine's facts as JSON: GPU name, torch/CUDA/cuDNN/triton versions, driver, date."""
import json
import subprocess
import sys
import time

import torch
import triton

if not torch.cuda.is_available():
    print("env_json: error: needs a CUDA GPU; this machine has none", file=sys.stderr)
    sys.exit(2)
print(json.dumps(dict(
    date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0), torch=torch.__version__,
    cuda=torch.version.cuda, cudnn=torch.backends.cudnn.version(), triton=triton.__version__,
    driver=subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()), indent=1))
