"""Local control plane: etcd + kube-apiserver built from Go modules, run on loopback."""
