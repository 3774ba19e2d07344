// fake-kubelet serves the kubelet's PodResources v1 API on a unix socket, with the kubelet's own
// generated code (k8s.io/kubelet) and gRPC server (google.golang.org/grpc), so the agent's client
// is tested against the real protocol. What List, Get and GetAllocatableResources answer is read
// from a JSON file on every call (the protobuf field names, as encoding/json reads the generated
// structs), so a test changes the answer by rewriting the file:
//
//	{"pod_resources": [{"name": "p", "namespace": "ns", "containers": [
//	    {"name": "c", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-..."]}],
//	     "dynamic_resources": [{"claim_name": "gpu", "claim_namespace": "ns", "claim_resources": [
//	         {"driver_name": "gpu.nvidia.com", "pool_name": "node-a", "device_name": "gpu-0",
//	          "cdi_devices": [{"name": "k8s.gpu.nvidia.com/claim=<uid>-gpu-0"}]}]}]}]}],
//	 "error": {"code": 14, "message": "..."},   // List answers with this gRPC status instead
//	 "delay_ms": 0,                              // wait this long before answering List
//	 "allocatable": {"devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-...::0"]}]},
//	 "allocatable_error": {"code": 12, "message": "..."},  // GetAllocatableResources's status
//	 "get_error": {"code": 14, "message": "..."},          // Get's status
//	 "kubelet": "1.37"}
//
// "kubelet" picks whose behaviour it shows: "1.37" (the default) answers as kubelet 1.37 does
// (dynamic resources listed, Get served, a pod Get cannot find an error of code Unknown);
// "1.35-gates-off" as kubelet 1.34 or 1.35 with the KubeletPodResourcesDynamicResources and
// KubeletPodResourcesGet gates off (no dynamic resources; Get answers "PodResources API Get
// method disabled", code Unknown); "1.26" as a kubelet before either existed (no dynamic
// resources; Get Unimplemented, as the generated server answers a method it lacks).
//
// Each call is counted on stdout ("list N", "get N"), after "ready" once the socket listens.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

type grpcError struct {
	Code    uint32 `json:"code"`
	Message string `json:"message"`
}

type answer struct {
	PodResources     []*podresourcesv1.PodResources               `json:"pod_resources,omitempty"`
	Error            *grpcError                                   `json:"error,omitempty"`
	DelayMs          int                                          `json:"delay_ms,omitempty"`
	Allocatable      *podresourcesv1.AllocatableResourcesResponse `json:"allocatable,omitempty"`
	AllocatableError *grpcError                                   `json:"allocatable_error,omitempty"`
	GetError         *grpcError                                   `json:"get_error,omitempty"`
	Kubelet          string                                       `json:"kubelet,omitempty"`
}

const (
	kubelet137       = "1.37"
	kubeletGatesOff  = "1.35-gates-off"
	kubeletBeforeDRA = "1.26"
)

type server struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	answers string
	lists   atomic.Int64
	gets    atomic.Int64
}

func (s *server) read() (*answer, error) {
	data, err := os.ReadFile(s.answers)
	if err != nil {
		return nil, status.Errorf(codes.Internal, "fake kubelet: %v", err)
	}
	var a answer
	if err := json.Unmarshal(data, &a); err != nil {
		return nil, status.Errorf(codes.Internal, "fake kubelet: %s: %v", s.answers, err)
	}
	switch a.Kubelet {
	case "":
		a.Kubelet = kubelet137
	case kubelet137, kubeletGatesOff, kubeletBeforeDRA:
	default:
		return nil, status.Errorf(codes.Internal, "fake kubelet: unknown kubelet %q", a.Kubelet)
	}
	if a.Kubelet != kubelet137 { // a kubelet that does not list what DRA drivers prepared
		for _, pod := range a.PodResources {
			for _, container := range pod.Containers {
				container.DynamicResources = nil
			}
		}
	}
	return &a, nil
}

func (s *server) List(ctx context.Context, _ *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	n := s.lists.Add(1)
	defer fmt.Printf("list %d\n", n)
	a, err := s.read()
	if err != nil {
		return nil, err
	}
	if a.DelayMs > 0 {
		select {
		case <-time.After(time.Duration(a.DelayMs) * time.Millisecond):
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	if a.Error != nil {
		return nil, status.Error(codes.Code(a.Error.Code), a.Error.Message)
	}
	return &podresourcesv1.ListPodResourcesResponse{PodResources: a.PodResources}, nil
}

// Get answers as the kubelet's v1PodResourcesServer.Get does: the pod by namespace and name, or
// a plain error (which gRPC sends as code Unknown) when it has no such pod.
func (s *server) Get(ctx context.Context, req *podresourcesv1.GetPodResourcesRequest) (*podresourcesv1.GetPodResourcesResponse, error) {
	n := s.gets.Add(1)
	defer fmt.Printf("get %d\n", n)
	a, err := s.read()
	if err != nil {
		return nil, err
	}
	switch a.Kubelet {
	case kubeletBeforeDRA:
		return s.UnimplementedPodResourcesListerServer.Get(ctx, req)
	case kubeletGatesOff:
		return nil, fmt.Errorf("PodResources API Get method disabled")
	}
	if a.GetError != nil {
		return nil, status.Error(codes.Code(a.GetError.Code), a.GetError.Message)
	}
	for _, pod := range a.PodResources {
		if pod.Name == req.PodName && pod.Namespace == req.PodNamespace {
			return &podresourcesv1.GetPodResourcesResponse{PodResources: pod}, nil
		}
	}
	return nil, fmt.Errorf("pod %s in namespace %s not found", req.PodName, req.PodNamespace)
}

func (s *server) GetAllocatableResources(context.Context, *podresourcesv1.AllocatableResourcesRequest) (*podresourcesv1.AllocatableResourcesResponse, error) {
	a, err := s.read()
	if err != nil {
		return nil, err
	}
	if a.AllocatableError != nil {
		return nil, status.Error(codes.Code(a.AllocatableError.Code), a.AllocatableError.Message)
	}
	if a.Allocatable == nil {
		return &podresourcesv1.AllocatableResourcesResponse{}, nil
	}
	return a.Allocatable, nil
}

func main() {
	socket := flag.String("socket", "", "unix socket to serve on")
	answers := flag.String("answers", "", "JSON file read on every call")
	flag.Parse()
	if *socket == "" || *answers == "" {
		fmt.Fprintln(os.Stderr, "usage: fake-kubelet --socket PATH --answers FILE")
		os.Exit(2)
	}
	_ = os.Remove(*socket)
	listener, err := net.Listen("unix", *socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// The kubelet's own limit on the size of a PodResources answer.
	grpcServer := grpc.NewServer(grpc.MaxSendMsgSize(16 * 1024 * 1024))
	podresourcesv1.RegisterPodResourcesListerServer(grpcServer, &server{answers: *answers})
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		grpcServer.Stop()
	}()
	fmt.Println("ready")
	if err := grpcServer.Serve(listener); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
