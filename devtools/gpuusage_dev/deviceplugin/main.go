// gpuusage-device-plugin advertises the GPUs of a scenario to a real kubelet through the
// kubelet's own device-plugin API (k8s.io/kubelet deviceplugin v1beta1, served by gRPC), so that
// the scheduler, the kubelet and PodResources hand out real device IDs on the local node. One
// endpoint per resource (the API registers one resource per socket): each lists its devices
// (the GPU or MIG UUIDs) as healthy and, on Allocate, gives the container
// NVIDIA_VISIBLE_DEVICES with the devices it got, as NVIDIA's plugin does.
//
// The resources come from a JSON file: {"nvidia.com/gpu": ["GPU-...", ...],
// "nvidia.com/mig-1g.10gb": ["MIG-..."]}. A kubelet that restarts removes the plugins' sockets:
// the plugin notices, serves again and registers again. It prints "registered <resource>" each
// time a registration is accepted.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type plugin struct {
	pluginapi.UnimplementedDevicePluginServer
	resource string
	devices  []string
	socket   string
	server   *grpc.Server
	stop     chan struct{}
}

func (p *plugin) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (p *plugin) ListAndWatch(_ *pluginapi.Empty, stream grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	listed := make([]*pluginapi.Device, 0, len(p.devices))
	for _, id := range p.devices {
		listed = append(listed, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: listed}); err != nil {
		return err
	}
	select {
	case <-stream.Context().Done():
	case <-p.stop:
	}
	return nil
}

func (p *plugin) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (p *plugin) Allocate(_ context.Context, request *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	answer := &pluginapi.AllocateResponse{}
	for _, container := range request.GetContainerRequests() {
		// A time-slicing replica (<UUID>::<n>) is its GPU to the container, as NVIDIA's plugin has it.
		var visible []string
		seen := map[string]bool{}
		for _, id := range container.GetDevicesIds() {
			device, _, _ := strings.Cut(id, "::")
			if !seen[device] {
				seen[device] = true
				visible = append(visible, device)
			}
		}
		answer.ContainerResponses = append(answer.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(visible, ",")},
		})
	}
	return answer, nil
}

func (p *plugin) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func (p *plugin) serve() error {
	_ = os.Remove(p.socket)
	listener, err := net.Listen("unix", p.socket)
	if err != nil {
		return err
	}
	p.stop = make(chan struct{})
	p.server = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(p.server, p)
	go func() { _ = p.server.Serve(listener) }()
	return nil
}

func (p *plugin) halt() {
	if p.server != nil {
		close(p.stop)
		p.server.Stop()
		p.server = nil
	}
}

func (p *plugin) register(kubelet string) error {
	conn, err := grpc.NewClient("unix://"+kubelet, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     filepath.Base(p.socket),
		ResourceName: p.resource,
		Options:      &pluginapi.DevicePluginOptions{},
	})
	return err
}

func main() {
	kubelet := flag.String("kubelet-socket", pluginapi.KubeletSocket, "the kubelet's registration socket")
	resourcesFile := flag.String("resources", "", "JSON file: resource name -> device IDs")
	flag.Parse()
	raw, err := os.ReadFile(*resourcesFile)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	resources := map[string][]string{}
	if err := json.Unmarshal(raw, &resources); err != nil {
		fmt.Fprintln(os.Stderr, "resources:", err)
		os.Exit(2)
	}
	names := make([]string, 0, len(resources))
	for name := range resources {
		names = append(names, name)
	}
	sort.Strings(names)
	folder := filepath.Dir(*kubelet)
	plugins := []*plugin{}
	for _, name := range names {
		safe := strings.NewReplacer("/", "_", ".", "_").Replace(name)
		plugins = append(plugins, &plugin{
			resource: name,
			devices:  resources[name],
			socket:   filepath.Join(folder, "gpuusage-"+safe+".sock"),
		})
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	registered := map[string]bool{}
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		// The kubelet empties this folder when its device manager starts, then makes its own
		// socket: serve only once that is there, and serve again whenever ours is gone.
		if _, err := os.Stat(*kubelet); err == nil {
			for _, p := range plugins {
				if _, err := os.Stat(p.socket); err != nil && p.server != nil {
					p.halt()
					registered[p.resource] = false
				}
				if registered[p.resource] {
					continue
				}
				if p.server == nil {
					if err := p.serve(); err != nil {
						fmt.Fprintln(os.Stderr, "serve", p.resource, err)
						continue
					}
				}
				if err := p.register(*kubelet); err != nil {
					fmt.Fprintln(os.Stderr, "register", p.resource, err)
					continue
				}
				registered[p.resource] = true
				fmt.Println("registered", p.resource)
			}
		}
		select {
		case <-signals:
			for _, p := range plugins {
				p.halt()
				_ = os.Remove(p.socket)
			}
			return
		case <-tick.C:
		}
	}
}
