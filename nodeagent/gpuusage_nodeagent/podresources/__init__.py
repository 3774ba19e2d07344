"""The kubelet's PodResources API: which devices the device manager gave each pod."""
