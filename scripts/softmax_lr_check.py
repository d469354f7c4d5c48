#!/usr/bin/env python3
"""The training example's learning rate, checked on the CPU: the same softmax regression as
examples/train_cifar_gpu.rs (normalized CIFAR-10 pixels as 3,072 features, random flip, batch
256, drop_last, plain SGD, gradient (softmax - onehot) / n), in numpy, for a few learning rates.
Prints the mean loss per epoch for each.

    python3 scripts/softmax_lr_check.py path/to/cifar10-test   # needs numpy and pillow
"""
import os
import sys

import numpy as np
from PIL import Image

root = sys.argv[1] if len(sys.argv) > 1 else sys.exit(__doc__)
classes=sorted(os.listdir(root))
X=[];Y=[]
for k,c in enumerate(classes):
    for f in sorted(os.listdir(os.path.join(root,c))):
        X.append(np.asarray(Image.open(os.path.join(root,c,f)).convert('RGB'),dtype=np.float32)); Y.append(k)
X=np.stack(X)/255.0; Y=np.array(Y)
mean=np.array([0.4914,0.4822,0.4465],np.float32); std=np.array([0.2470,0.2435,0.2616],np.float32)
X=((X-mean)/std).transpose(0,3,1,2)  # NCHW
N=len(X); d=3*32*32
for lr in [0.05,0.02,0.01,0.005]:
    rng=np.random.default_rng(0); W=np.zeros((d,10),np.float32); b=np.zeros(10,np.float32)
    curve=[]
    for ep in range(5):
        perm=rng.permutation(N); losses=[]
        for i in range(0,N-255,256):
            idx=perm[i:i+256]; x=X[idx].copy()
            flip=rng.random(len(idx))<0.5; x[flip]=x[flip][...,::-1]
            x=x.reshape(len(idx),d); z=x@W+b; z-=z.max(1,keepdims=True)
            p=np.exp(z); p/=p.sum(1,keepdims=True)
            losses.append(-np.log(p[np.arange(len(idx)),Y[idx]]+1e-12).mean())
            g=p; g[np.arange(len(idx)),Y[idx]]-=1; g/=len(idx)
            W-=lr*(x.T@g); b-=lr*g.sum(0)
        curve.append(np.mean(losses))
    print(lr, ' '.join(f'{c:.3f}' for c in curve))
