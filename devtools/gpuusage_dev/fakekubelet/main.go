// fake-kubelet serves the kubelet's PodResources v1 API on a unix socket, with the kubelet's own
// generated code (k8s.io/kubelet) and gRPC server (google.golang.org/grpc), so the agent's client
// is tested against the real protocol. What List and GetAllocatableResources answer is read from
// a JSON file on every call (the protobuf field names, as encoding/json reads the generated
// structs), so a test changes the answer by rewriting the file:
//
//	{"pod_resources": [{"name": "p", "namespace": "ns", "containers": [
//	    {"name": "c", "devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-..."]}]}]}],
//	 "error": {"code": 14, "message": "..."},   // List answers with this gRPC status instead
//	 "delay_ms": 0,                              // wait this long before answering List
//	 "allocatable": {"devices": [{"resource_name": "nvidia.com/gpu", "device_ids": ["GPU-...::0"]}]},
//	 "allocatable_error": {"code": 12, "message": "..."}}  // GetAllocatableResources's status
//
// Each call is counted on stdout ("list N"), after "ready" once the socket listens.
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
	podresourcesv1.ListPodResourcesResponse
	Error            *grpcError                                   `json:"error,omitempty"`
	DelayMs          int                                          `json:"delay_ms,omitempty"`
	Allocatable      *podresourcesv1.AllocatableResourcesResponse `json:"allocatable,omitempty"`
	AllocatableError *grpcError                                   `json:"allocatable_error,omitempty"`
}

type server struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	answers string
	calls   atomic.Int64
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
	return &a, nil
}

func (s *server) List(ctx context.Context, _ *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	n := s.calls.Add(1)
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
	return &a.ListPodResourcesResponse, nil
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
	answers := flag.String("answers", "", "JSON file read on every List call")
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
